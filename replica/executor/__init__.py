"""The executor: Llama-family model, checkpoint loading (GGUF / HF), tokenizer, model runner, sampler.

Nothing is re-exported here: checkpoint, config and tokenizer load no torch, and the ingress, which
only tokenizes, imports them without the model.
"""
