"""The bottom layer: pytrees (``tree``), explicit random keys (``random``), context variables (``context``), donated buffers, text tables and byte counts, process settings."""
