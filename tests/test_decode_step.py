"""``DecodeStep.validate``: the step inputs the decoder would run silently wrong are refused
(by the harness and the CLI on every step, and by a user who calls it)."""

import dataclasses

import pytest
import torch

from kimi_inductor.stock import KimiK3Config, KimiLinearForCausalLM, Parallel
from kimi_inductor.stock.batch import DecodeBatch
from kimi_inductor.stock.state import DecodeStep

SIZES = dict(vocab_size=512, block_size=4, num_blocks=1 + 3 * 4, num_slots=1 + 3 * 4)


def edit(s: DecodeStep, name: str, fn) -> DecodeStep:
    t = getattr(s, name).clone()
    fn(t)
    return dataclasses.replace(s, **{name: t})


CASES = {
    "token_past_vocab": (lambda s: edit(s, "input_ids", lambda t: t.__setitem__(5, 512)),
                         r"DecodeStep.input_ids\[5\] = 512 is outside the vocabulary 0..511"),
    "negative_token": (lambda s: edit(s, "input_ids", lambda t: t.__setitem__(0, -1)),
                       r"DecodeStep.input_ids\[0\] = -1 is outside the vocabulary"),
    "accepted_zero": (lambda s: edit(s, "num_accepted", lambda t: t.__setitem__(1, 0)),
                      r"DecodeStep.num_accepted\[1\] = 0 is outside 1..q = 1..4"),
    "accepted_past_q": (lambda s: edit(s, "num_accepted", lambda t: t.__setitem__(2, 5)),
                        r"DecodeStep.num_accepted\[2\] = 5 is outside 1..q"),
    "seq_len_past_capacity": (lambda s: edit(s, "seq_lens", lambda t: t.__setitem__(0, 17)),
                              r"DecodeStep.seq_lens\[0\] = 17 exceeds the block table's capacity, 4 blocks x 4 = 16"),
    "negative_block": (lambda s: edit(s, "block_table", lambda t: t.__setitem__((1, 0), -3)),
                       r"DecodeStep.block_table\[1, 0\] = -3 is not a cache block \(0..12\)"),
    "block_past_cache": (lambda s: edit(s, "block_table", lambda t: t.__setitem__((1, 0), 13)),
                         r"DecodeStep.block_table\[1, 0\] = 13 is not a cache block"),
    "shared_block": (lambda s: edit(s, "block_table", lambda t: t.__setitem__((2, 0), int(t[0, 0]))),
                     r"block 1 is used by request 0 and by request 2 \(block_table\[2, 0\]\)"),
    "q_9": (lambda s: dataclasses.replace(s, state_slots=torch.ones(4, 9, dtype=torch.int32)),
            r"DecodeStep.state_slots \[R, q\]: q = 9 tokens per request is outside 1..8"),
    "rows_not_R_q": (lambda s: dataclasses.replace(s, input_ids=s.input_ids[:-1]),
                     r"DecodeStep.input_ids has shape \(15,\), expected \(16,\)"),
    "live_request_marked_padding": (lambda s: edit(s, "is_padding", lambda t: t.__setitem__(4, True)),
                                    r"DecodeStep.is_padding\[4\] = True but request 1 has seq_len"),
    "live_request_without_state_slot": (lambda s: edit(s, "state_slots", lambda t: t.__setitem__((1, 0), 0)),
                                        r"DecodeStep.state_slots\[1, 0\] = 0 marks request 1 as padding"),
    "shared_state_slot": (lambda s: edit(s, "state_slots", lambda t: t.__setitem__((1, 1), int(t[0, 1]))),
                          "a KDA state slot appears twice"),
}


def test_batch_steps_are_valid():
    batch = DecodeBatch(3, 4, 1, 512, block_size=4, max_context=16)
    for _ in range(3):
        batch.step().validate(**SIZES)
        batch.accept()


@pytest.mark.parametrize("case", sorted(CASES))
def test_validate_refuses(case):
    make, message = CASES[case]
    s = DecodeBatch(3, 4, 1, 512, block_size=4, max_context=16).step()
    s.validate(**SIZES)
    with pytest.raises(ValueError, match=message):
        make(s).validate(**SIZES)


def test_model_validates_against_its_vocab_and_caches():
    config = KimiK3Config.preset("tiny")
    model = KimiLinearForCausalLM(config, Parallel(), device="meta")
    batch = DecodeBatch(2, 2, 0, config.vocab_size, block_size=4, max_context=8)
    caches = model.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, batch.q, device="meta")
    s = model.validate_step(batch.step(), caches)
    with pytest.raises(ValueError, match=r"input_ids\[0\] = 512 is outside the vocabulary 0..511"):
        model.validate_step(edit(s, "input_ids", lambda t: t.__setitem__(0, 512)), caches)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 9 exceeds the block table's capacity, 2 blocks x 4"):
        model.validate_step(edit(s, "seq_lens", lambda t: t.__setitem__(0, 9)), caches)
    other = model.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, 4, device="meta")
    with pytest.raises(ValueError, match=r"caches were allocated for q = 4 .* the step has q = 2"):
        model.validate_step(s, other)
    with pytest.raises(ValueError, match="allocate_caches: q = 9 tokens per request is outside 1..8"):
        model.allocate_caches(5, 5, 4, 9, device="meta")


def test_the_harness_validates_every_step(monkeypatch):
    """A token id past the vocabulary: an IndexError on one rank, a silent zero embedding
    on two; the harness (and so the CLI) refuses the step first."""
    from kimi_inductor.harness import DecodeRun, decode

    original = DecodeBatch.step

    def bad_step(self):
        s = original(self)
        s.input_ids[0] = self.vocab
        return s

    monkeypatch.setattr(DecodeBatch, "step", bad_step)
    with pytest.raises(ValueError, match=r"input_ids\[0\] = 512 is outside the vocabulary 0..511"):
        decode(DecodeRun(steps=1, requests=1, padding=0))
