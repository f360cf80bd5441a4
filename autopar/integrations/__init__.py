"""autopar inside training frameworks: `autopar.integrations.hf` (the Hugging Face Trainer).

Each integration is its own module, imported by name: importing `autopar` imports none of them, nor the
framework they need.
"""
