# What one device call carries (sourced by gpu_issue11.sh and gpu_issue13.sh): the tree
# (tracked + untracked, not ignored) plus the carried folders, under the call's 64 MiB, kept to
# TRAVEL_LIMIT (63 MiB: 1 MiB of margin).
TRAVEL_LIMIT=$(( 63 * 1048576 ))

tree_bytes() {  # -> the bytes of the tree that every call sends
  git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1
}

travel_check() {  # CARRIED... -> prints tree + carried; fails when over TRAVEL_LIMIT
  local tree carried
  tree=$(tree_bytes)
  carried=$(du -cb "$@" | tail -1 | cut -f1)
  echo "travels: tree $(( tree / 1048576 )) MiB + $* $(( carried / 1048576 )) MiB"
  if (( tree + carried > TRAVEL_LIMIT )); then
    echo "that is over the $(( TRAVEL_LIMIT / 1048576 )) MiB allowed a device call (64 MiB, less a margin)" >&2
    return 1
  fi
}

pack_parts() {  # SRC OUT DATA: SRC's weights in fp16 parts OUT/1..K (bench/weight_parts.py), each
  # sized so that it travels beside the tree with DATA (which goes into part 1 as OUT/1/data);
  # $PART_MB overrides the size; fails when a part would be under 4 MiB or over the limit
  local src=$1 out=$2 data=$3 tree bytes mb part
  tree=$(tree_bytes)
  bytes=$(du -sb "$data" | cut -f1)
  mb=${PART_MB:-$(( (TRAVEL_LIMIT - tree - bytes) / 1048576 - 1 ))}
  (( mb >= 4 )) || { echo "only $mb MiB left for a part beside the tree: too little" >&2; return 2; }
  echo "parts of at most $mb MiB (tree $(( tree / 1048576 )) MiB, data $(( bytes / 1048576 )) MiB)"
  python bench/weight_parts.py split "$src" "$out" --part-mb "$mb"
  mv "$data" "$out/1/data"
  for part in "$out"/*; do  # each call carries one part beside the tree
    travel_check "$part" || return 2
  done
}

exclude() {  # here: keep a folder out of git (and so out of the tree that travels unless carried)
  local file; file=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$file")"
  grep -qx "$1" "$file" 2>/dev/null || echo "$1" >> "$file"
}

unpack_data() {  # DIR (on the device): DIR/data.tar.xz (bench/data_pack.py) unpacked in place,
  # once; nothing to do for a folder carried unpacked
  [ -f "$1/data.tar.xz" ] || return 0
  python3 bench/data_pack.py unpack "$1"
}
