"""A command collects Python's garbage rarely through its start-up and freezes what it made once its
model has loaded (kvcache/gcpolicy.py); a library user's process is left as it is."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_collection_waits_for_the_model_in_a_command_and_never_changes_for_a_library_user():
    code = textwrap.dedent("""
        import gc
        from kvcache import LLM, gcpolicy
        frozen, usual = gc.get_freeze_count(), gc.get_threshold()
        LLM()  # a library user: nothing deferred, nothing frozen
        assert gc.get_threshold() == usual and gc.get_freeze_count() == frozen, gc.get_freeze_count()
        gcpolicy.defer()  # what kvcache's main does first
        assert gc.get_threshold() == gcpolicy.START_UP and gc.isenabled()
        gcpolicy.settle()
        gcpolicy.defer()
        llm = LLM()  # the load settles it
        assert gc.get_threshold() == usual and gc.get_freeze_count() > frozen + 10000, gc.get_freeze_count()
        gcpolicy.settle()  # a second settle does nothing
        assert gc.get_threshold() == usual
        print("ok")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_the_console_command_defers_from_its_first_line():
    code = textwrap.dedent("""
        import gc, sys
        from kvcache import cli, gcpolicy
        usual, seen = gc.get_threshold(), []
        cli.build_parser = lambda: seen.append(gc.get_threshold()) or sys.exit(0)
        try:
            cli.main(["models"])
        except SystemExit:
            pass
        assert seen == [gcpolicy.START_UP] and gc.get_threshold() == usual, (seen, gc.get_threshold())
        print("ok")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
