"""The executor: Llama-family model, checkpoint loading (GGUF / HF), tokenizer, model runner, sampler, and the
tensor-parallel ranks (parallel.py: the shards and collectives; worker.py, multiproc.py: the ranks' processes).

Nothing is re-exported here: checkpoint, config and tokenizer load no torch, and the ingress, which
only tokenizes, imports them without the model.
"""
