# tokenmill on the official PyTorch CUDA runtime image. Build and run (docs/docker.md):
#   docker build -t tokenmill .
#   docker run --gpus all --ipc=host -v "$PWD/runs:/work/runs" tokenmill train --preset demo
# Another PyTorch/CUDA pair: --build-arg PYTORCH_IMAGE=pytorch/pytorch:<torch>-cuda<12.x>-cudnn9-runtime
ARG PYTORCH_IMAGE=pytorch/pytorch:2.10.0-cuda12.8-cudnn9-runtime
FROM ${PYTORCH_IMAGE}

# A C compiler: Triton (torch.compile, model.norm='triton') builds small launchers at run time,
# and the runtime image has none.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TOKENMILL_CACHE=/cache/tokenmill \
    TIKTOKEN_CACHE_DIR=/cache/tiktoken

WORKDIR /opt/tokenmill
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
# Keep the image's CUDA build of torch: pin it as a constraint so no extra can replace it.
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/torch-constraint.txt \
    && pip install --constraint /tmp/torch-constraint.txt ".[all]" \
    && rm /tmp/torch-constraint.txt \
    && tokenmill --version

WORKDIR /work
ENTRYPOINT ["tokenmill"]
CMD ["--help"]
