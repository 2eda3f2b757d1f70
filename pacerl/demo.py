"""`pacerl demo`: a scripted tool-using agent solving problems in a real sandbox, then hostile code
contained. Later issues grow this into `pacerl train` on the embedded defaults."""

from __future__ import annotations

import random
import time

from rich.console import Console
from rich.table import Table

from pacerl.sandbox import ExecStatus, Limits, Sandbox

HOSTILE = {
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "memory bomb": "blocks = []\nwhile True:\n    blocks.append(bytearray(10**8))",
    "infinite loop": "while True:\n    pass",
    "output flood": "while True:\n    print('spam' * 1000)",
    "read host secrets": "print(open('/root/.bashrc').read())",
    "phone home": "import socket\nsocket.create_connection(('1.1.1.1', 443), timeout=2)",
    "escape the work dir": "open('/usr/bin/evil', 'w').write('x')",
}


def _scripted_turns(a: int, b: int, c: int) -> list[str]:
    """What a tool-integrated reasoning policy writes, turn by turn, for `a * b + c`."""
    return [f"product = {a} * {b}\nproduct", f"answer = product + {c}\nanswer"]


def run_demo(backend: str = "local", problems: int = 4, seed: int = 0) -> int:
    """Solve `problems` arithmetic tasks through a persistent sandbox session, then run hostile code."""
    console = Console()
    rng = random.Random(seed)
    solved = 0
    with Sandbox(backend, limits=Limits(timeout_s=2, memory_mb=256, output_kill_bytes=1 << 20)) as sandbox:
        console.rule(f"[bold]pacerl demo: a tool-using agent in the {backend} sandbox")
        for index in range(problems):
            a, b, c = rng.randint(100, 999), rng.randint(100, 999), rng.randint(1, 99)
            with sandbox.session() as session:  # one live interpreter per episode
                console.print(f"[bold]task {index + 1}[/]: what is {a} * {b} + {c}?")
                result = None
                for turn, code in enumerate(_scripted_turns(a, b, c), start=1):
                    result = session.run(code)
                    console.print(
                        f"  turn {turn}: [cyan]{code.splitlines()[0]} ...[/] -> {result.stdout.strip()}"
                    )
                answer = result.stdout.strip() if result else ""
                correct = answer == str(a * b + c)
                solved += correct
                console.print(
                    f"  answer \\boxed{{{answer}}}: {'[green]correct' if correct else '[red]wrong'}"
                )

        table = Table(title="hostile code, contained")
        for column in ("attack", "status", "reason / output", "seconds"):
            table.add_column(column)
        contained = 0
        for name, code in HOSTILE.items():
            started = time.monotonic()
            result = sandbox.run(code)
            seconds = time.monotonic() - started
            contained += result.status is not ExecStatus.OK
            last_error_line = (result.stderr.strip().splitlines() or [result.reason])[-1]
            detail = (last_error_line if result.status is ExecStatus.ERROR else result.reason)[:60]
            table.add_row(name, result.status.value, detail, f"{seconds:.2f}")
        console.print(table)
    console.print(f"solved {solved}/{problems}; contained {contained}/{len(HOSTILE)} attacks")
    return 0 if solved == problems and contained == len(HOSTILE) else 1
