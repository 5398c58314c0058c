"""The teacher-forcing helpers, which `tokenq bench quant` shares with the tests."""

from tokenq.bench.teacher_forcing import Agreement, agreement, engine_logits, hf_logits

__all__ = ["Agreement", "agreement", "engine_logits", "hf_logits"]
