# What one device call carries (sourced by the gpu_issue*.sh stages that pack, here): the tree
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
