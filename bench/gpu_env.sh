# Sourced by the bench/gpu_issue*.sh device stages, from the repository root: makes
# mhmla_fast.kernels importable. It lives in kernels/ (a package-dir mapping); a legacy
# editable install (a .pth naming the repo root) cannot map it, and neither can running from
# the repo root. Then this runs from a symlinked copy of the tree in which mhmla_fast/kernels
# points at kernels/ (OUT made absolute first).
# unbuffered output: a step cut by its timeout still leaves its lines in its log
export PYTHONUNBUFFERED=1
importable() { (cd /tmp && python3 -c "import mhmla_fast.kernels.layer_attention") 2>/dev/null \
  && python3 -c "import mhmla_fast.kernels.layer_attention" 2>/dev/null; }
if ! importable; then
  if [ "$PWD" != /tmp/mhmla_tree ]; then
    rm -rf /tmp/mhmla_tree && cp -rs "$PWD" /tmp/mhmla_tree
    ln -sfn /tmp/mhmla_tree/kernels /tmp/mhmla_tree/mhmla_fast/kernels
    echo "note: mhmla_fast.kernels not importable from $PWD; running from /tmp/mhmla_tree" >&2
    case "$OUT" in /*) ;; *) OUT=$PWD/$OUT ;; esac
    export OUT
    cd /tmp/mhmla_tree
  fi
  export PYTHONPATH=/tmp/mhmla_tree${PYTHONPATH:+:$PYTHONPATH}
fi
