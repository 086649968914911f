"""pddlink.routing"""
