"""The Kimi Linear synthetic tasks (palindrome, MQAR, stack), the mixers compared on them, one grid cell's
training loop, and the long-context data mode with its needle-in-a-haystack eval; user docs in
``docs/synthetic.md``."""
