"""Prefill-worker Ray actor: prefill-only engine plus the hand-off sender (cluster issue)."""
