# parts.sh: sourced by scripts that carry large files to the GPU machine, which
# takes at most 64 MiB a call.
#
# split_into_folders FILE PART_MIB PREFIX FIRST
#   Splits FILE into equal parts of at most PART_MIB MiB, named
#   <basename>.partNN, one part per folder PREFIX<FIRST>, PREFIX<FIRST+1>, ...
#   (created). Prints the number of parts. Reassemble with `cat` of the parts
#   in name order.
split_into_folders() {
    local file="$1" part_mib="$2" prefix="$3" n="$4" size nparts tmp p
    size="$(stat -c %s "$file")"
    nparts=$(( (size + part_mib * 1048576 - 1) / (part_mib * 1048576) ))
    tmp="$(mktemp -d)"
    split -n "$nparts" -d -a 2 "$file" "$tmp/$(basename "$file").part"
    for p in "$tmp"/*; do
        mkdir -p "${prefix}${n}"
        mv "$p" "${prefix}${n}/"
        n=$((n + 1))
    done
    rmdir "$tmp"
    echo "$nparts"
}
