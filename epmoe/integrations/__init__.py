"""Adapters that put ``epmoe.EPMoE`` into other frameworks' models.

One module per framework, imported only when asked for; none of them imports its framework
before it is needed:

* ``epmoe.integrations.huggingface``: ``EPMoEBlock`` and ``replace_moe_blocks`` swap the MoE
  blocks of Hugging Face ``transformers`` models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
  DeepSeek-V3, GLM-4-MoE) for expert-parallel ones (``pip install "epmoe[hf]"``).
"""
