"""Apache TVM backend (relax) — see issue: TVM backend."""
