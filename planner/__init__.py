"""The capacity rule and the activation solver: pure functions of job and worker profiles, no database.
The control plane's estimate, the scheduler's reconcile tick and the simulator all plan with them."""
