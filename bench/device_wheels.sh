#!/bin/bash
# The Python packages a GPU machine lent through the device tool lacks, as wheels in .whl/ (git-ignored), so
# that bench/gpu.py and bench/scale.py run there:
#
#     bash bench/device_wheels.sh            # here, once (~1 min, ~48 MB)
#     # there, at the start of each command, with .whl carried:
#     rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#     export PYTHONPATH=$PWD:/tmp/site
#
# That machine (2026-11) has Python 3.12, torch 2.11 with CUDA, numpy 2.5, scipy built for numpy 2, and most of
# hivemind's needs; not hivemind and what follows. numpy stays the machine's: a carried numpy 1 breaks its scipy,
# which hivemind imports. Our codecs do not need hivemind's numpy-1-only 8-bit ones. prefetch_generator,
# python-baseconv and varint exist only as source: built into wheels here (pure Python). Checked on an H200,
# 2026-11-27: `bench/scale.py --model llama-1b` ran with these.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
mkdir -p .whl
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_12 manylinux_2_5 \
         manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
wheels=(annotated-types==0.8.0 async-generator==1.10 base58==2.1.1 blake3==1.0.11 cffi==2.1.1 ConfigArgParse==1.9.0
        cryptography==50.0.2 dnspython==2.9.2 grpcio==1.85.3 grpcio-tools==1.85.1 hivemind==1.1.12
        importlib_metadata==10.2.0 lazy-importer==0.1.0 mmh3==5.3.1 morphys==1.0 multiaddr==0.2.0 netaddr==1.3.0
        outcome==1.3.0.post0 protobuf==7.36.2 py-cid==0.5.0 py-multibase==2.0.0 py-multicodec==1.0.0
        py-multihash==3.0.0 pycparser==3.12 pydantic==2.14.4 pydantic_core==2.50.5 sniffio==1.3.1 trio==0.35.0
        trio-typing==0.10.0 typing-inspection==0.4.5)
for wheel in "${wheels[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" --platform any -d .whl "$wheel"
done
python3 -m pip wheel -q --no-deps -w .whl python-baseconv==1.2.2 varint==1.0.2 prefetch_generator==1.0.3
echo "$(ls .whl/*.whl | wc -l) wheels in .whl ($(du -sh .whl | cut -f1)); carry .whl (the device tool's limit: 64 MiB)"
