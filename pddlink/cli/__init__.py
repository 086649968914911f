"""pddlink.cli"""
