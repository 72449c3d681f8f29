"""Malformed requests."""

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

from harness import *  # noqa: F401,F403 (the harness is these tests' vocabulary)
from harness import _process_running  # noqa: F401


class TestProtocol(DriverTestCase):
    def test_malformed_requests(self):
        driver = self.driver
        driver.send_raw(b"this is not json")
        frame = driver.next_frame(TIMEOUT)
        self.assertEqual(frame["type"], "protocol_error")
        self.assertTrue(frame["message"])

        driver.send_raw(b"\xff\xfe")
        self.assertEqual(driver.next_frame(TIMEOUT)["type"], "protocol_error")

        driver.send({"type": "bogus", "id": "b1"})
        frame = driver.next_frame(TIMEOUT)
        self.assertEqual((frame["type"], frame.get("id")), ("protocol_error", "b1"))

        for bad in ({"type": "execute", "id": "b2", "language": "python"},
                    {"type": "execute", "id": "b3", "language": "cobol", "code": ""},
                    {"type": "execute", "id": "b4", "language": "python", "code": "", "stdout_limit": -1},
                    {"type": "execute", "id": "b5", "language": "python", "code": "", "get_files": "a.txt"},
                    {"type": "execute", "id": "b6", "language": "python", "code": "", "get_files": ["a", 1]},
                    {"type": "execute", "id": "b7", "language": "python", "code": "",
                     "get_files": ["f%d" % i for i in range(65)]},
                    {"type": "execute", "id": "b8", "language": "python", "code": "", "list_files": "yes"},
                    {"type": "stats", "id": 5}):
            driver.send(bad)
            frame = driver.next_frame(TIMEOUT)
            expected_id = bad["id"] if isinstance(bad["id"], str) else None
            self.assertEqual((frame["type"], frame.get("id")), ("protocol_error", expected_id))
        self.assertAlive()


if __name__ == "__main__":
    unittest.main(verbosity=2)
