"""The prefill floor runs the model's own unskippable work: the same attention products and exps."""

import numpy as np
import pytest

from kvstate.bench.prefill_floor import PARTS, PrefillFloor, attention_arithmetic, best_parts, best_run
from kvstate.model import GPT2, GPT2Config, numpy_gpt2
from kvstate.model.numpy_gpt2 import attend, rechunk


def _recorded(monkeypatch):
    """Shapes of every ``np.matmul`` and sizes of every ``np.exp`` called while it is patched."""
    calls = {"matmul": [], "exp": []}
    matmul, exp = np.matmul, np.exp

    def recording_matmul(a, b, **kwargs):
        calls["matmul"].append((a.shape, b.shape))
        return matmul(a, b, **kwargs)

    def recording_exp(x, **kwargs):
        calls["exp"].append(x.size)
        return exp(x, **kwargs)
    monkeypatch.setattr(np, "matmul", recording_matmul)
    monkeypatch.setattr(np, "exp", recording_exp)
    return calls


@pytest.mark.parametrize("n, threads", [(1, 1), (64, 1), (200, 1), (200, 2)])
def test_the_floors_attention_runs_the_models_products_and_exps(monkeypatch, n, threads):
    monkeypatch.setattr(numpy_gpt2, "SPLIT_FROM_ROWS", 100)        # 200 rows split, as 1,024 would
    heads, width = 4, 8
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n, heads, width), dtype=np.float32) for _ in range(3))
    model = _recorded(monkeypatch)
    attend(q, list(rechunk([(k, v)], numpy_gpt2.ATTENTION_BLOCK)), 0, threads)
    model = {kind: list(found) for kind, found in model.items()}
    monkeypatch.undo()
    monkeypatch.setattr(numpy_gpt2, "SPLIT_FROM_ROWS", 100)
    floor = _recorded(monkeypatch)
    attention_arithmetic(q.transpose(1, 0, 2).copy(), k, v, threads)
    assert model["matmul"] and sorted(floor["matmul"]) == sorted(model["matmul"])
    assert sorted(floor["exp"]) == sorted(model["exp"])


def test_a_floor_run_times_each_part_of_a_small_models_prefill():
    model = GPT2.random(GPT2Config.tiny())
    parts = best_run(PrefillFloor(model, 40), 2)
    assert set(parts) == {*PARTS, "total"} and all(parts[part] > 0 for part in PARTS)
    assert parts["total"] == pytest.approx(sum(parts[part] for part in PARTS))


def test_the_floor_takes_each_part_at_its_fastest_run():
    runs = [{"weights": 3.0, "attention": 1.0, "gelu_exp": 0.5}, {"weights": 2.0, "attention": 1.5, "gelu_exp": 0.25}]
    assert best_parts(runs) == {"weights": 2.0, "attention": 1.0, "gelu_exp": 0.25, "total": 3.25}
