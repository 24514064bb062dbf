"""`attnres-pp export`: a trained run as a Hugging Face model folder (`cli`): the weights as
safetensors (`weights`), config.json and generation_config.json (`configs`), the run's tokenizer
(`tokenizer`), and for every model that is not transformers' own Llama or Qwen3 the code that runs
it (`remote/`, copied into the folder)."""
