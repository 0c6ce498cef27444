"""The robot side runs on a Jetson without PyTorch: nothing in agent/ may import it."""
import subprocess
import sys


def test_agent_never_imports_torch():
    code = ("import sys, agent.cli, agent.decoder, agent.drafter, agent.link, agent.daemon, agent.api, agent.nav, "
            "agent.robot.sim, agent.robot.perception, agent.robot.controllers.serial, agent.robot.scripted; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"agent imported {r.stdout.strip()}: {r.stderr[-500:]}"
