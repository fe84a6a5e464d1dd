"""The top floor: `echo2-server`, the local stack and the demo, which start and run the other planes.
They import api, scheduler and learner; nothing there imports them."""
