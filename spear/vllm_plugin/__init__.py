"""Serve spear checkpoints on vLLM: the quantization method ``spear`` (docs/vllm.md).

vLLM calls :func:`register` in each of its processes through the ``vllm.general_plugins``
entry point (pyproject.toml). Nothing imports vLLM before that, so the pure parts
(:mod:`~spear.vllm_plugin.sharding`, :mod:`~spear.vllm_plugin.kernel_adapter`) import and are
tested without it.
"""


def register() -> None:
    """Register ``spear`` with vLLM (importing the config class registers it; safe to repeat)."""
    from spear.vllm_plugin import config  # noqa: F401
