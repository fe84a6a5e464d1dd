"""The Tinker learner host: it claims a Tinker model's requests from the control plane and runs them
(host.py), on a model session (session.py) with Tinker's losses (losses.py) and sampling by the replayable
sampler (sampler.py)."""
