"""The learner's rollout source and weight sink (learner/sources.py): the control plane's HTTP client is
both, and the in-process ones drive the learner's parts as the control plane does: claims ahead and
reports in order (pipeline.py), versions published as keyframes and deltas (publisher.py)."""

from __future__ import annotations

import hashlib
import threading
import time
from types import SimpleNamespace

import torch
from echo2.possession import read_range
from echo2.protocol import ClaimedGroup, JobSpec, JobStatus, SampleSubmit, StepAck, StepReport, WeightsConfig

from learner.loop import Learner, LearnerOptions
from learner.parallel import Solo
from learner.pipeline import Ahead, Committer
from learner.publisher import Publisher
from learner.remote import ControlPlane
from learner.sources import LocalRollouts, LocalWeights, RolloutSource, WeightSink
from learner.weights import Weights

SPEC = JobSpec.model_validate({"name": "s", "base_model": "echo2:tiny", "task": {"name": "arithmetic"},
                               "staleness": 1, "max_steps": 2, "grpo": {"group_size": 2, "prompts_per_step": 2}})


def group(i: int, version: int) -> ClaimedGroup:
    sample = SampleSubmit(token_ids=[3], logprobs=[-1.0], finish_reason="stop")
    return ClaimedGroup(rollout_id=f"rol_{i}", prompt_id=i, prompt_text="hi", reference=None, version=version,
                        worker_id="wrk_1", prompt_token_ids=[1, 2], samples=[sample, sample])


def test_the_control_plane_client_and_the_local_ones_are_sources_and_sinks(tmp_path):
    plane = ControlPlane("http://127.0.0.1:9", "token", "job")
    assert isinstance(plane, RolloutSource) and isinstance(plane, WeightSink)
    assert isinstance(LocalRollouts(SPEC), RolloutSource) and isinstance(LocalWeights(tmp_path), WeightSink)
    plane.close()


def test_local_rollouts_keep_the_staleness_rule():
    source = LocalRollouts(SPEC)
    source.put([group(0, 0), group(1, 3), group(2, 2), group(3, 1)])
    batch = source.claim(2, max_groups=4)  # at step 2 with S = 1: version 0 is stale, version 3 comes later
    assert [g.rollout_id for g in batch.groups] == ["rol_2", "rol_3"] and batch.rejected_stale == 1
    assert [g.rollout_id for g in source.claim(3, max_groups=4).groups] == ["rol_1"]
    assert source.claim(3, max_groups=4, wait_s=0.05).groups == []


def test_claims_ahead_and_reports_in_order_against_an_in_process_source():
    source = LocalRollouts(SPEC)
    source.put([group(i, 0) for i in range(4)])
    ahead, committer = Ahead(source, want=2), Committer(source)
    ahead.start(1)
    ahead.collected(0)
    acks: list[StepAck] = []
    committer.submit(StepReport(step=0, rollout_ids=["rol_a"], t_train_s=0.1), acks.append)
    committer.submit(StepReport(step=1, rollout_ids=["rol_b"], t_train_s=0.1), acks.append)
    assert committer.wait() == acks[-1] and [a.step for a in acks] == [1, 2] and acks[-1].stop
    assert [r.step for r in source.reports] == [0, 1]
    assert len(ahead.take(1)) == 2 and ahead.take(2) == []
    ahead.close()
    committer.close()


def test_a_claim_ahead_waits_until_the_step_before_has_its_groups(tmp_path):
    """The ack of step t - 1 starts the claims for t + 1, often while step t still waits for its groups. Claiming
    then, they took the groups step t waited for; at the end of an epoch no other came (the pool starts the next
    one only once every prompt is trained) and the learner waited for good (24 prompts, R = 8, S = 2)."""
    spec = JobSpec.model_validate({**SPEC.model_dump(), "staleness": 2, "max_steps": 10, "publish_period": 3})
    source = LocalRollouts(spec)
    learner = Learner(source, LearnerOptions(work_dir=tmp_path))  # type: ignore[arg-type]
    trainer = SimpleNamespace(auditor=None, audit_claimed=lambda groups: [])
    ahead, committer = Ahead(source, want=2), Committer(source)
    source.put([group(0, 0), group(1, 0)])
    first = learner._collect(spec, trainer, 0, ahead)  # type: ignore[arg-type]
    report = StepReport(step=0, rollout_ids=[g.rollout_id for g in first], t_train_s=0.1)
    learner._commit(spec, trainer, None, committer, ahead, report, set())  # type: ignore[arg-type]
    assert committer.wait().step == 1  # acknowledged: claims for step 2 are due
    source.put([group(2, 0), group(3, 0)])  # the epoch's last groups
    deadline = time.monotonic() + 1.0
    while source._queued and time.monotonic() < deadline:
        time.sleep(0.02)
    collected: list[list[ClaimedGroup] | None] = []
    collecting = threading.Thread(target=lambda: collected.append(learner._collect(spec, trainer, 1, ahead)))
    collecting.start()
    collecting.join(timeout=5)
    learner.last_ack = StepAck(step=1, job_status=JobStatus.cancelled, stop=True)  # a stalled step gives up
    collecting.join()
    started = ahead.held()  # and once step 1 has its groups, the claims for step 2 begin
    ahead.close()
    committer.close()
    assert collected[0] is not None and [g.rollout_id for g in collected[0]] == ["rol_2", "rol_3"]
    assert list(started) == [2]


def test_the_publisher_publishes_keyframes_and_deltas_to_an_in_process_sink(tmp_path, tiny):
    model, tok = tiny
    sink = LocalWeights(tmp_path / "published")
    publisher = Publisher(sink, Weights(model, tok, torch.float32), tmp_path / "publish", chunk_size=64 * 1024,
                          config=WeightsConfig(keyframe_every=2))
    for v in range(3):
        state = Solo().model_state(model)
        state["model.norm.weight"][0] += v  # each version changes one weight: its delta is small
        publisher.submit(v, v, state, final=v == 2)
        publisher.wait()
    publisher.close()
    assert [(v.version, v.total_size is not None, v.delta_base) for v in sink.versions] == [
        (0, True, None), (1, False, 0), (2, True, 1)]  # the first, every 2nd and the final in full
    before, after = sink.version_files(0), sink.version_files(1)  # version 1 as its delta rebuilds it
    assert [f.path for f in before] == [f.path for f in after] and before != after
    assert (tmp_path / "published" / "v1" / "delta").is_dir() and publisher.published == 2


def test_probes_are_drawn_where_a_version_differs_from_the_one_before(tmp_path, tiny):
    model, tok = tiny
    sink = LocalWeights(tmp_path / "published")
    publisher = Publisher(sink, Weights(model, tok, torch.float32), tmp_path / "publish", chunk_size=64 * 1024,
                          config=WeightsConfig(delta=False))
    for v in range(2):
        state = Solo().model_state(model)
        for name in [n for n in state if n.startswith("model.layers.1.")]:  # about half the bytes change
            state[name] += v
        publisher.submit(v, v, state)
        publisher.wait()
    publisher.close()
    folders, files = [tmp_path / "published" / f"v{v}" / "full" for v in range(2)], sink.version_files(1)
    assert len(sink.probes[0]) == len(sink.probes[1]) == 32
    for p in sink.probes[1]:  # the answer is in version 1's copy, and in no copy of version 0
        data = read_range(folders[1], files, p.offset, p.length)
        assert hashlib.sha256(data).hexdigest() == p.sha256 and p.length == 4096
        assert read_range(folders[0], files, p.offset, p.length) != data
