"""placeholder"""
def add_parser(subparsers):
    p = subparsers.add_parser("reshard", help="reshard")
    p.set_defaults(run=lambda a: 0)
