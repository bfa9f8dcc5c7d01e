"""Speculative decoding (issue 38): what proposes the next tokens of a row, and its config.

Pure Python and numpy (no jax): a proposer reads a request's token ids on the host.
``strata_jax.engine.speculation`` uses them to verify proposals in the engine's step.
"""

from strata_jax.spec.config import SpeculativeConfig, parse_speculative_config
from strata_jax.spec.proposer import NgramProposer, Proposer

__all__ = ["NgramProposer", "Proposer", "SpeculativeConfig", "parse_speculative_config"]
