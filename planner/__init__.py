"""The capacity rule and the activation solver: pure functions of job and worker profiles, no database.
The control plane's estimate and the scheduler's reconcile tick plan with them, and so does the simulator
(planner/sim/), a discrete-event model of a deployment, pure like them."""
