"""Decoder language models over ``cfx.nn`` layers (see ``cfx.models``)."""
