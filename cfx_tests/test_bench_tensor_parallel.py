"""``python -m cfx.bench tensor_parallel``: what each scheme sends per block, whom it talks to and what
it holds per rank equal its closed-form formula (``cfx._src.parallel.tp_cost``), for block sizes and
variants drawn by hypothesis; the formulas' table at P = 8, 64, 1000."""
import pytest
from hypothesis import given, strategies as st

from cfx._src.parallel import tp_cost
from cfx.bench.tensor_parallel import GRIDS, MEDIUM, formula_table, measure
from cfx_tests.budget import examples

ROWS = {"1d": 1, "2d": 2, "2.5d": 4, "3d": 4}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scheme", ["1d", "2d", "2.5d", "3d"])
@examples(ci=3)
@given(rows=st.sampled_from([1, 2]), T=st.integers(1, 6), heads=st.sampled_from([4, 8]), D=st.sampled_from([2, 4]),
       gqa=st.booleans(), norm=st.sampled_from(["layernorm", "rmsnorm"]), bias=st.booleans(),
       act=st.sampled_from(["gelu_tanh", "swiglu"]))
def test_bytes_peers_params_and_activations_are_the_formulas(scheme, rows, T, heads, D, gqa, norm, bias, act):
    kv = 4 if gqa and heads == 8 else None  # kv heads split over 1D's 4 ranks too
    m = measure(scheme, GRIDS[scheme][0], B=4 * rows, T=T, C=heads * D, H=heads, n_kv_heads=kv,
                norm=norm, bias=bias, activation=act)
    assert m["wire"] == pytest.approx(m["f_wire"], rel=1e-12) and m["wire"] > 0
    assert m["peers"] == m["f_peers"]
    assert m["params"] == pytest.approx(m["f_params"], rel=1e-12)
    assert m["acts"] == pytest.approx(m["f_acts"], rel=1e-12)


def test_the_seeds_comparison_at_a_thousand_ranks():
    table = {(r["P"], r["scheme"]): r for r in formula_table()}
    one, cube, tess = table[1000, "1d"], table[1000, "3d"], table[1000, "2.5d"]
    assert (one["peers"], one["group"]) == (999, 999)
    assert (cube["q"], cube["peers"], cube["group"]) == (10, 27, 9)  # 9 per collective, over 3 groups
    assert (tess["q"], tess["d"]) == (10, 10) and not table[1000, "2d"]["exact"]  # 1000 is no square
    # 3D sends a fraction of Megatron's bytes and holds 1/1000 of the weights and activations
    assert cube["comm"] < one["comm"] / 20 and cube["acts"] == one["acts"] / 1000
    for P in (8, 64, 1000):  # Megatron's bytes per rank grow towards 8 M C; the grids' shrink with P
        assert table[P, "1d"]["comm"] == pytest.approx(8 * (P - 1) / P * MEDIUM.M * MEDIUM.C * 4)
    assert table[1000, "3d"]["comm"] < table[64, "3d"]["comm"] < table[8, "3d"]["comm"]


def test_grids_of_p():
    assert tp_cost.grid_of("2.5d", 8) == (2, 2) and tp_cost.grid_of("2.5d", 64) == (4, 4)
    assert tp_cost.grid_of("2d", 64) == (8, 1) and tp_cost.grid_of("3d", 64) == (4, 4)
    with pytest.raises(ValueError, match="no q x q x d grid"):
        tp_cost.grid_of("2.5d", 7)
