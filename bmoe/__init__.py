"""bmoe: run Mixture-of-Experts GGUF models larger than RAM by streaming routed experts from flash.

The module map is in docs/architecture.md.
"""
