"""splitserve's front door: CLI, request lifecycle, prefill/decode choice, cluster launch."""
