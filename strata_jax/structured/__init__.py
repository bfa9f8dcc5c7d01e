"""Structured outputs: output constraints (JSON schema, JSON object, regex, choice, grammar)
compiled with llguidance and applied as a token mask inside the jitted sampling step.

* ``spec.py``    ``StructuredOutput``: the constraint and its validated, cached grammar
* ``matcher.py`` ``GrammarState``: a request's matcher and next-token mask (engine host side)

See docs/serving.md ("Structured outputs") for the request fields the server accepts.
"""

from strata_jax.structured.spec import KINDS, StructuredOutput

__all__ = ["KINDS", "StructuredOutput"]
