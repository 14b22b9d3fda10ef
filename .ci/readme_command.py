"""Print command N (1 or 2) of the README's first ```bash block, so CI runs exactly what a newcomer reads."""
import sys
from pathlib import Path

text = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()
block = text.split("```bash\n", 1)[1].split("```", 1)[0]
commands = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
n = int(sys.argv[1])
if len(commands) < n:
    sys.exit(f"README.md: the first bash block has {len(commands)} command(s), not {n}")
print(commands[n - 1])
