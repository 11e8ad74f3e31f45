"""A tiny authoritative DNS server for the tests' fake internet: answers A
queries for a fixed set of names and NXDOMAIN for everything else (UDP only).

    python3 fakenet_dns.py LISTEN_ADDR name=addr [name=addr ...]
"""

import socket
import struct
import sys


def main() -> None:
    listen = sys.argv[1]
    records = dict(arg.split("=", 1) for arg in sys.argv[2:])
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((listen, 53))
    while True:
        query, peer = sock.recvfrom(512)
        if len(query) < 12:
            continue
        ident, _flags, qdcount = struct.unpack("!HHH", query[:6])
        # The question: labels up to a zero byte, then type and class.
        pos, labels = 12, []
        while pos < len(query) and query[pos] != 0:
            length = query[pos]
            labels.append(query[pos + 1 : pos + 1 + length].decode(errors="replace"))
            pos += 1 + length
        question = query[12 : pos + 5]
        qtype = struct.unpack("!H", query[pos + 1 : pos + 3])[0] if pos + 3 <= len(query) else 0
        name = ".".join(labels).lower()
        address = records.get(name)
        if address is None:
            header = struct.pack("!HHHHHH", ident, 0x8183, 1, 0, 0, 0)  # NXDOMAIN
            sock.sendto(header + question, peer)
            continue
        answers = b""
        if qtype == 1:
            answers = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + socket.inet_aton(address)
        header = struct.pack("!HHHHHH", ident, 0x8180, 1, 1 if answers else 0, 0, 0)
        sock.sendto(header + question + answers, peer)


if __name__ == "__main__":
    main()
