"""`attnres-pp export`: a trained run as a Hugging Face model folder (`cli`): the weights as
safetensors (`weights`), config.json and generation_config.json (`configs`), the run's tokenizer
(`tokenizer`), and for every model that is not transformers' own Llama, Qwen3, Mixtral or Qwen3-MoE
the code that runs it (`remote/`, copied into the folder)."""
