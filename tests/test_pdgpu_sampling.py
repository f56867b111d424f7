"""Sampling (pdgpu/sampling.py, pdgpu/sampler.py): the rules as OpenAI / vLLM define them,
checked on logits whose answer is known, and the draw's distribution, seed and batch
independence."""

from __future__ import annotations

import math

import pytest
import torch

from pdgpu.sampler import Sampler, Step
from pdgpu.sampling import GREEDY, Sampling, problem, uniform

PROBS = [0.5, 0.3, 0.15, 0.05]  # a distribution whose filters' answers are known
DRAWS = 4000


def logits_of(probs, rows: int = 1) -> torch.Tensor:
    return torch.log(torch.tensor(probs)).repeat(rows, 1)  # [rows, V]


def frequencies(sampling: Sampling, probs=PROBS) -> list[float]:
    """How often each token is drawn over DRAWS seeds (one batch)."""
    steps = [Step(attrs_seed(sampling, seed), 0) for seed in range(DRAWS)]
    tokens = Sampler(len(probs), "cpu").pick(logits_of(probs, DRAWS), steps)
    return (torch.bincount(tokens, minlength=len(probs)).double() / DRAWS).tolist()


def attrs_seed(sampling: Sampling, seed: int) -> Sampling:
    import attrs
    return attrs.evolve(sampling, seed=seed)


def close_to(observed: list[float], expected: list[float]) -> bool:
    """Within 4 standard errors of a DRAWS-sample frequency (and exactly 0 where 0)."""
    return all((e == 0 and o == 0) or (e > 0 and abs(o - e) <= 4 * math.sqrt(e * (1 - e) / DRAWS))
               for o, e in zip(observed, expected, strict=True))


def test_plain_greedy_is_the_argmax_and_top_k_1_equals_it():
    """Temperature 0 is the argmax; top_k = 1 at any temperature draws the argmax too."""
    torch.manual_seed(0)
    logits = torch.randn(16, 50)
    sampler = Sampler(50, "cpu")
    assert torch.equal(sampler.pick(logits, [Step(GREEDY, 3)] * 16), logits.argmax(-1))
    topk = [Step(Sampling(temperature=1.7, top_k=1, seed=s), s) for s in range(16)]
    assert torch.equal(sampler.pick(logits, topk), logits.argmax(-1))


def test_temperature_draws_follow_the_softmax():
    """At temperature 1 tokens come with their probabilities; at 0.5 with p^2 renormalized."""
    assert close_to(frequencies(Sampling(temperature=1.0)), PROBS)
    squared = [p * p / sum(q * q for q in PROBS) for p in PROBS]
    assert close_to(frequencies(Sampling(temperature=0.5)), squared)
    assert not close_to(frequencies(Sampling(temperature=0.5)), PROBS)


@pytest.mark.parametrize("options, kept", [
    ({"top_p": 0.7}, [0, 1]),  # 0.5 < 0.7 <= 0.8: the second token completes the mass
    ({"top_p": 0.5}, [0]),
    ({"top_p": 0.81}, [0, 1, 2]),
    ({"top_k": 3}, [0, 1, 2]),
    ({"top_k": 2, "top_p": 0.9}, [0, 1]),
    ({"min_p": 0.2}, [0, 1, 2]),  # below 0.2 x 0.5 = 0.1: dropped
    ({"min_p": 0.7}, [0]),
    ({"min_p": 0.5, "top_p": 0.55}, [0]),
])
def test_filters_keep_the_tokens_they_should_renormalized(options, kept):
    """top_p, top_k and min_p keep exactly these tokens, drawn in their renormalized ratio."""
    mass = sum(PROBS[i] for i in kept)
    expected = [PROBS[i] / mass if i in kept else 0.0 for i in range(len(PROBS))]
    assert close_to(frequencies(Sampling(temperature=1.0, **options)), expected)


def test_a_seed_reproduces_alone_and_in_any_batch():
    """A row's token depends on its logits, options, seed and position only: the same alone,
    in a batch of others (greedy, filtered, penalized) in any order; another seed differs."""
    torch.manual_seed(1)
    logits = torch.randn(6, 40)
    steps = [Step(Sampling(temperature=0.9, seed=7), 4), Step(GREEDY, 2),
             Step(Sampling(temperature=1.3, top_p=0.8, seed=8), 0),
             Step(Sampling(temperature=0.7, top_k=5, min_p=0.05, seed=9), 11),
             Step(Sampling(temperature=1.0, seed=10, presence_penalty=0.5), 1),
             Step(Sampling(repetition_penalty=1.3), 5, ban=(3,))]
    together = Sampler(40, "cpu").pick(logits, steps)
    for i in range(6):
        assert Sampler(40, "cpu").pick(logits[i:i + 1], [steps[i]]).item() == together[i]
    no_top_p = [i for i, s in enumerate(steps) if s.sampling.top_p == 1]  # top_k by topk()
    assert Sampler(40, "cpu").pick(logits[no_top_p], [steps[i] for i in no_top_p]).tolist() \
        == together[no_top_p].tolist()
    order = [5, 3, 1, 0, 4, 2]
    shuffled = Sampler(40, "cpu").pick(logits[order], [steps[i] for i in order])
    assert shuffled.tolist() == together[order].tolist()
    others = [Sampler(40, "cpu").pick(logits[:1], [Step(Sampling(temperature=0.9, seed=s), 4)])
              for s in range(20)]
    assert len({t.item() for t in others}) > 1
    positions = Sampler(40, "cpu").pick(torch.zeros(20, 40), [
        Step(Sampling(temperature=1.0, seed=7), p) for p in range(20)])
    assert len(set(positions.tolist())) > 1  # each position draws anew


@pytest.mark.parametrize("options, output, prompt, chosen", [
    ({"frequency_penalty": 0.3}, [0, 0], [], 1),  # 2.0 - 2 x 0.3 = 1.4 < 1.5
    ({"frequency_penalty": 0.2}, [0, 0], [], 0),  # 1.6 > 1.5
    ({"presence_penalty": 0.6}, [0, 0], [], 1),  # once, however often: 1.4
    ({"presence_penalty": 0.4}, [0, 0], [], 0),
    ({"presence_penalty": 0.6}, [], [0], 0),  # the prompt is not the output
    ({"repetition_penalty": 1.4}, [], [0], 1),  # 2.0 / 1.4 = 1.43 < 1.5 (the prompt counts)
    ({"repetition_penalty": 1.2}, [0], [], 0),  # 1.67
    ({"repetition_penalty": 1.4}, [], [3], 2),  # -1.0 x 1.4 = -1.4 < -1.2
    ({"repetition_penalty": 1.1}, [], [3], 3),  # -1.1 > -1.2
])
def test_penalties_change_logits_as_vllm_defines_them(options, output, prompt, chosen):
    """Greedy over logits [2, 1.5, -1.2, -1] with each penalty on either side of the margin."""
    logits = torch.tensor([[2.0, 1.5, -1.2, -1.0]])
    if chosen in (2, 3):
        logits = torch.tensor([[-3.0, -3.0, -1.2, -1.0]])
    sampler = Sampler(4, "cpu")
    sampling = Sampling(**options)
    slot = sampler.open(sampling, prompt, output)
    assert sampler.pick(logits, [Step(sampling, len(output), slot=slot)]).item() == chosen


def test_drawn_tokens_are_counted_for_the_next_step_and_a_slot_is_reused_empty():
    """A penalized request's own tokens penalize its later steps; its freed slot starts
    empty for the next request."""
    sampler = Sampler(3, "cpu")
    sampling = Sampling(frequency_penalty=0.4)
    slot = sampler.open(sampling, [])
    logits = torch.tensor([[1.0, 0.7, 0.0]])
    picks = [sampler.pick(logits, [Step(sampling, p, slot=slot)]).item() for p in range(3)]
    assert picks == [0, 1, 0]  # 1.0; then 0.6 < 0.7; then 0.6 vs 0.3: token 0 again
    sampler.close(slot)
    again = sampler.open(sampling, [])
    assert again == slot and sampler.pick(logits, [Step(sampling, 0, slot=again)]).item() == 0


def test_bans_keep_stop_tokens_out_and_uniform_is_a_function_of_seed_and_position():
    """A banned token is never drawn, even greedy; uniform() is fixed by (seed, position)."""
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    assert Sampler(3, "cpu").pick(logits, [Step(GREEDY, 0, ban=(0,))]).item() == 1
    drawn = Sampler(3, "cpu").pick(logits.repeat(50, 1), [
        Step(Sampling(temperature=2.0, seed=s), 0, ban=(0,)) for s in range(50)])
    assert 0 not in drawn.tolist()
    values = [uniform(s, p) for s in (0, 1, -5, 2 ** 64 - 1) for p in range(50)]
    assert all(0 <= v < 1 for v in values) and len(set(values)) == len(values)
    assert uniform(3, 4) == uniform(3, 4)


@pytest.mark.parametrize("field, value, ok", [
    ("temperature", 0, True), ("temperature", -0.1, False), ("temperature", "1", False),
    ("temperature", math.inf, False), ("top_p", 0.0, False), ("top_p", 1, True),
    ("top_p", 1.01, False), ("top_k", -1, True), ("top_k", -2, False), ("top_k", 1.5, False),
    ("min_p", 1.0, True), ("min_p", -0.1, False), ("presence_penalty", 2.0, True),
    ("presence_penalty", 2.5, False), ("frequency_penalty", -2.01, False),
    ("repetition_penalty", 0, False), ("repetition_penalty", 2.5, True),
    ("seed", -1, True), ("seed", 2 ** 64, False), ("seed", True, False),
    ("min_tokens", -1, False), ("ignore_eos", 1, False), ("ignore_eos", True, True),
])
def test_out_of_range_options_are_named(field, value, ok):
    """Each option's range as vLLM checks it; a refusal says what the rule is."""
    found = problem(field, value)
    assert (found is None) == ok
    if not ok:
        assert "must" in found and repr(value) in found


def test_logprobs_are_the_raw_distributions_whatever_the_draw():
    """Each row's drawn token's log-probability and its top alternatives come from the raw
    logits' log-softmax (not the temperature's or the penalties'), asked rows only."""
    from pdgpu.sampler import logprobs
    torch.manual_seed(2)
    logits = torch.randn(3, 30)
    steps = [Step(Sampling(temperature=1.5, seed=1, logprobs=4), 0), Step(GREEDY, 0),
             Step(Sampling(repetition_penalty=1.5, logprobs=0), 0)]
    sampler = Sampler(30, "cpu")
    steps[2] = steps[2]._replace(slot=sampler.open(steps[2].sampling, [int(logits[2].argmax())]))
    tokens, found = sampler.draw(logits, steps)
    logp = torch.log_softmax(logits, dim=-1)
    for row, (chosen, top) in enumerate(found):
        assert chosen == pytest.approx(logp[row, tokens[row]].item())
        assert [i for i, _ in top] == logp[row].topk(4).indices.tolist()
        assert [v for _, v in top] == pytest.approx(logp[row].topk(4).values.tolist())
    assert tokens[2] != logits[2].argmax()  # the penalty moved the draw, not the logprobs
    assert logprobs(logits, tokens, 0)[1] == (pytest.approx(logp[1, tokens[1]].item()), ())
    assert Sampler(30, "cpu").draw(logits, [Step(GREEDY, 0)] * 3)[1] is None
