"""pddlink.drc"""
