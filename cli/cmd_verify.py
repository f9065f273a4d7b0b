"""placeholder"""
def add_parser(subparsers):
    p = subparsers.add_parser("verify", help="verify")
    p.set_defaults(run=lambda a: 0)
