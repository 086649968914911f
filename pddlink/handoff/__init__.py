"""pddlink.handoff"""
