"""pddlink.transport"""
