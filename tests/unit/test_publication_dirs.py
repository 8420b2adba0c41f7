"""Weight-publication folders: named by host and process, and removed once that process
is gone, so a run killed with SIGKILL leaves nothing behind in /dev/shm past the next
start (the run itself removes its folder when it ends)."""

from __future__ import annotations

import os
import socket
import subprocess

from thundersync_core.rollout.weights import publication_dir, remove_abandoned_publications


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_only_this_hosts_dead_runs_lose_their_folders(tmp_path):
    host = socket.gethostname()
    dead = tmp_path / f"thundersync-publish-{host}-{dead_pid()}-run-1"
    live = tmp_path / f"thundersync-publish-{host}-{os.getpid()}-run-2"
    other_host = tmp_path / f"thundersync-publish-{host}x-{dead_pid()}-run-3"
    unrelated = tmp_path / "thundersync-bench-sync-4"
    for folder in (dead, live, other_host, unrelated):
        folder.mkdir()
        (folder / "policy-v000001.safetensors").write_bytes(b"weights")
    assert remove_abandoned_publications(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (live, other_host, unrelated)
    )


def test_a_new_folder_names_this_host_and_process():
    folder = publication_dir("my-run")
    assert folder.name.startswith(f"thundersync-publish-{socket.gethostname()}-{os.getpid()}-")
    assert "-my-run-" in folder.name
    assert not folder.exists()  # the learner creates it
