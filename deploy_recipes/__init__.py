"""Getting the device server onto boards: SSH bootstrap, emulated boards, service units."""
