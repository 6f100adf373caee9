"""Functional layers: frozen dataclasses with ``init`` / ``apply`` / ``axes`` (see ``cfx.nn``)."""
