"""How long a worker waits between two rotations of ``jobs``' slots."""

from __future__ import annotations

from kombu_pgskip.background import ROTATE_MAX_S, ROTATE_S, rotation_delay


def test_a_worker_rotates_every_second_while_rotations_succeed() -> None:
    assert rotation_delay(0) == ROTATE_S == 1.0


def test_each_failed_rotation_doubles_the_wait_up_to_a_minute() -> None:
    assert [rotation_delay(n) for n in range(1, 8)] == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert rotation_delay(10**6) == ROTATE_MAX_S == 60.0
