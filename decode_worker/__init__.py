"""Decode-worker Ray actor: decode-only engine, hand-off receiver, token stream (cluster issue)."""
