"""An MoE run's router statistics: each expert's share of the routed rows equals what transformers'
``MixtralForCausalLM`` routes (its ``router_logits``' top-k, counted), rows dropped over capacity are
counted, and ``python -m cfx.train --model mixtral`` reports them in its summary, ``--json`` and logs."""
import json

import pytest
import torch

import cfx
from cfx._src.train.moe_stats import router_summary
from cfx.train import TrainConfig, train
from cfx_tests.test_models_mixtral import V, pair

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("top_k", [1, 2])
def test_expert_shares_are_transformers_routing(top_k):
    model, params, hf = pair(torch.float64, top_k=top_k)
    batches = [(cfx.random.randint(cfx.random.key(i), (2, 12), 0, V), None) for i in range(3)]
    got = router_summary(model, params, batches)
    counts = torch.zeros(4, dtype=torch.float64)
    with torch.no_grad():
        for tokens, _ in batches:
            for logits in hf(tokens, output_router_logits=True).router_logits:  # (B*T, E) per layer
                counts += torch.bincount(logits.topk(top_k, -1).indices.reshape(-1), minlength=4)
    want = counts / counts.sum()
    assert got["expert_share"] == pytest.approx(want.tolist(), abs=1e-12)
    assert got["max_load"] == pytest.approx(float(want.max() * 4)) and got["dropped"] == 0.0
    assert router_summary(cfx.models.gpt2("tiny"), None, batches) is None  # no routers: nothing to say


def test_rows_over_capacity_are_counted_as_dropped():
    model, params, _ = pair(capacity_factor=0.5)  # half of an even share fits: at least half the rows drop
    batches = [(cfx.random.randint(cfx.random.key(0), (2, 16), 0, V), None)]
    got = router_summary(model, params, batches)
    _, stats = model.router_stats(params, batches[0][0])
    assert got["dropped"] == pytest.approx(float(sum(s.dropped for s in stats) / sum(s.counts.sum() for s in stats)))
    assert got["dropped"] >= 0.5 and sum(got["expert_share"]) == pytest.approx(1.0)


@pytest.mark.timeout(180)
def test_the_cli_reports_and_logs_the_routing(tmp_path, capsys):
    metrics, out = tmp_path / "m.jsonl", tmp_path / "s.json"
    summary = train(TrainConfig(model="mixtral", preset="tiny", steps=2, batch=2, seq=16, eval_every=0,
                                eval_batches=2, progress=False, sample_bytes=0, metrics=str(metrics), json=str(out)))
    router = summary["router"]
    assert len(router["expert_share"]) == summary["params"]["blocks"][0]["mlp"]["router"].shape[-1]
    assert sum(router["expert_share"]) == pytest.approx(1.0) and router["max_load"] >= 1.0
    assert "MoE routers (held-out batches)" in capsys.readouterr().out
    with open(metrics) as f:
        last = [json.loads(line) for line in f][-1]
    assert last == {"step": 2, "router_max_load": router["max_load"], "router_dropped": router["dropped"]}
    with open(out) as f:
        assert json.load(f)["router"] == router
