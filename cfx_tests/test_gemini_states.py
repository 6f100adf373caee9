"""Gemini tensor states: the transition function accepts exactly the legal sequences."""
import pytest
from hypothesis import given, strategies as st

from cfx.gemini import EVENTS, TRANSITIONS, IllegalTransition, TensorState as S, is_legal, transition

# Independent oracle: the legal (old, new) pairs, written out by hand.
LEGAL = {
    (S.FREE, S.HOLD),                                                  # gather
    (S.HOLD, S.COMPUTE), (S.HOLD, S.FREE),                             # pre_op, release
    (S.COMPUTE, S.HOLD_AFTER_FWD), (S.COMPUTE, S.HOLD_AFTER_BWD),      # post_fwd, post_bwd
    (S.COMPUTE, S.HOLD),                                               # post_op (no backward)
    (S.HOLD_AFTER_FWD, S.COMPUTE), (S.HOLD_AFTER_FWD, S.FREE),         # pre_bwd, release
    (S.HOLD_AFTER_FWD, S.HOLD),                                        # end_step without backward
    (S.HOLD_AFTER_BWD, S.COMPUTE), (S.HOLD_AFTER_BWD, S.HOLD),         # tied reuse, reduce
}


def run(seq, start=S.FREE):
    state = start
    for new in seq:
        state = transition(state, new, what="blocks.0.w")
    return state


def oracle_accepts(seq, start=S.FREE):
    state = start
    for new in seq:
        if (state, new) not in LEGAL:
            return False
        state = new
    return True


@given(st.lists(st.sampled_from(list(S)), max_size=12))
def test_transition_accepts_exactly_the_oracle_sequences(seq):
    if oracle_accepts(seq):
        assert run(seq) == (seq[-1] if seq else S.FREE)
    else:
        with pytest.raises(IllegalTransition, match="blocks.0.w"):
            run(seq)


@given(st.sampled_from(list(S)), st.integers(0, 30), st.data())
def test_random_walks_on_legal_pairs_are_accepted(state, length, data):
    # A walk built only from legal moves is accepted from its start, whatever its length.
    for _ in range(length):
        options = sorted((n for (o, n) in LEGAL if o == state), key=lambda s: s.name)
        new = data.draw(st.sampled_from(options))
        assert transition(state, new, what="x") == new
        state = new


def test_table_matches_oracle_and_documents_every_move():
    assert {(o, n) for o, ns in TRANSITIONS.items() for n in ns} == LEGAL
    assert set(TRANSITIONS) == set(S)
    for o, ns in TRANSITIONS.items():
        assert set(EVENTS[o]) == set(ns) and all(EVENTS[o][n] for n in ns)
    assert all(is_legal(o, n) == ((o, n) in LEGAL) for o in S for n in S)


def test_full_training_cycle_is_legal():
    cycle = [S.HOLD, S.COMPUTE, S.HOLD_AFTER_FWD,           # gather, forward
             S.FREE, S.HOLD,                                # released between fwd and bwd, re-gathered
             S.COMPUTE, S.HOLD_AFTER_BWD,                   # backward
             S.COMPUTE, S.HOLD_AFTER_BWD,                   # a tied weight's second gradient
             S.HOLD, S.COMPUTE, S.HOLD,                     # reduce, optimizer update
             S.FREE]                                        # release
    for _ in range(3):
        assert run(cycle) == S.FREE
    # kept gathered (no release between forward and backward), and an eval step
    assert run([S.HOLD, S.COMPUTE, S.HOLD_AFTER_FWD, S.COMPUTE, S.HOLD_AFTER_BWD, S.HOLD]) == S.HOLD
    assert run([S.HOLD, S.COMPUTE, S.HOLD, S.FREE]) == S.FREE


@pytest.mark.parametrize("old,new,hint", [
    (S.FREE, S.COMPUTE, "Gather the chunk"),
    (S.HOLD_AFTER_BWD, S.FREE, "Reduce the gradient"),
    (S.COMPUTE, S.FREE, "Finish the op"),
    (S.HOLD, S.HOLD, "legal next states are: COMPUTE"),
    (S.HOLD, S.HOLD_AFTER_BWD, "FREE \\(release"),
])
def test_illegal_moves_name_the_tensor_and_the_legal_states(old, new, hint):
    with pytest.raises(IllegalTransition, match=hint) as e:
        transition(old, new, what="'lm_head.w' in chunk 'c3'")
    assert "'lm_head.w' in chunk 'c3'" in str(e.value) and f"{old.name} -> {new.name}" in str(e.value)
    assert isinstance(e.value, ValueError)
